"""The hand-written kernels (:mod:`megatron_ext.kernels.native`) equal the eager reference bit for bit: the vector
build (this CPU: AVX-512 or AVX2), the AVX2 build where the CPU has it, and the portable build (the scalar loop alone,
which also serves every group's last bytes).

INT4 dequantize-reduce-requantize: any k (unrolled up to 8, a loop above), any even group size, split over threads at
any group. The fp32 codecs: any size (partial last groups, whole padding groups, empty inputs), both bit widths, any
group size (odd ones too), any k, any thread count (ByteGrad's k-row decode-and-average too); and the compiled
path's entry points route fp32 to them.
"""
import logging
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.kernels import compiled, native
from megatron_ext.kernels import reference as ref

from . import contract_cases

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the native kernel's builds are for x86-64")
# native: this CPU's best vector path; avx2: the AVX2 path, also where native is AVX-512; portable: the scalar loop
VARIANTS = ["native", "portable"] + (["avx2"] if " avx2" in native._cpu_flags() else [])


def _chunks(k, groups, group, seed):
    """k quantized chunks of random data, as qgZ receives them (some groups all zero)."""
    qs = []
    for i in range(k):
        g = torch.Generator().manual_seed(seed * 31 + i)
        x = torch.randn(groups * group, generator=g) * torch.rand(groups * group, generator=g).pow(3) * 8
        x[group: 2 * group] = 0.0 if i % 2 == 0 else x[group: 2 * group]
        qs.append(ref.quantize_symmetric(x, bits=4, group_size=group))
    return torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(k=st.integers(1, 10), group=st.sampled_from([2, 6, 32, 34, 64, 2048]), groups=st.integers(1, 12),
       threads=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_equals_reference(variant, k, group, groups, threads, seed):
    chunks, scales = _chunks(k, groups, group, seed)
    _same(native.int4_reduce_quantize(chunks, scales, group, threads=threads, variant=variant),
          ref.dequantize_reduce_quantize(chunks, scales, 4, group))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("repeat", [1, 2, 4, 5])  # groups of 4 bytes (scalar), 8 (AVX2), 16 (AVX-512), 20 (both)
def test_ties_round_to_even(variant, repeat):
    """Scales 1 and 1/2 make the fp32 sums exact ties: c0 = [7, 0, 0, 1, -2, 2, 6, -6], c1 = [0, 1, -1, 1, -1, 1, 1,
    -1] sum to [7, 0.5, -0.5, 1.5, -2.5, 2.5, 6.5, -6.5], whose codes at scale 7 / 7 are [7, 0, 0, 2, -2, 2, 6, -6]."""
    chunks = torch.tensor([[0x70, 0x01, 0xE2, 0x6A] * repeat, [0x01, 0xF1, 0xF1, 0x1F] * repeat], dtype=torch.uint8)
    scales = torch.tensor([[1.0], [0.5]])
    codes, out_scales = native.int4_reduce_quantize(chunks, scales, 8 * repeat, variant=variant)
    assert codes.tolist() == [0x70, 0x02, 0xE2, 0x6A] * repeat and out_scales.tolist() == [1.0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_subnormal_scales_clamp(variant):
    """A subnormal output scale is the one finite case where codes can leave [-7, 7] before the clamp."""
    group = 64
    chunks = torch.randint(0, 256, (2, 3 * group // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    scales = torch.tensor([[1e-45, 3e-44, 0.25], [2e-45, 1e-40, 0.0]])
    want = ref.dequantize_reduce_quantize(chunks, scales, 4, group)
    assert bool(((want[1] > 0) & (want[1] < 2.0 ** -126)).any())
    _same(native.int4_reduce_quantize(chunks, scales, group, variant=variant), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_finite_sums(variant):
    """Outside the bit contract, as for the compiled path: a group whose sum is inf or NaN gets codes clamped to
    [-7, 7] (the compiled path's codes; the reference wraps them) and an inf/NaN scale where the reference has one."""
    group = 64   # k = 2 chunks of group 64: the Inductor graph test_compiled.py compiles too (a cold cache compiles
    # it once for both files)
    chunks = torch.randint(0, 256, (2, 4 * group // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for bad in (float("inf"), float("nan"), 3e38):
        scales = torch.rand(2, 4, generator=torch.Generator().manual_seed(2))
        scales[0, 1] = scales[1, 2] = bad
        codes, out = native.int4_reduce_quantize(chunks, scales, group, variant=variant)
        want_codes, want = ref.dequantize_reduce_quantize(chunks, scales, 4, group)
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())
        finite = want.isfinite().repeat_interleave(group // 2)
        assert torch.equal(codes[finite], want_codes[finite])
        with compiled.use_compile("1"), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MX_KERNELS_NATIVE", "0")
            assert torch.equal(codes, compiled.dequantize_reduce_quantize(chunks, scales, 4, group)[0])


def test_compiled_path_uses_it(monkeypatch):
    """The compiled CPU path runs the native kernel for INT4 when its vector build is here, and Inductor's loop
    for INT8, with MX_KERNELS_NATIVE=0, or where it is not: the same bits either way."""
    if not native.available():
        pytest.skip("no AVX-512 or AVX2 here: the compiled path runs Inductor's loop")
    calls = []
    real = native.int4_reduce_quantize
    monkeypatch.setattr(native, "int4_reduce_quantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    chunks, scales = _chunks(4, 5, 2048, 0)
    want = ref.dequantize_reduce_quantize(chunks, scales, 4, 2048)
    for mode, expect in (("auto", [1]), ("1", [1, 1]), ("0", [1, 1])):  # auto: also below MIN_NUMEL; 0: eager
        with compiled.use_compile(mode):
            _same(compiled.dequantize_reduce_quantize(chunks, scales, 4, 2048), want)
        assert calls == expect, mode
    monkeypatch.setenv("MX_KERNELS_NATIVE", "0")
    with compiled.use_compile("1"):
        _same(compiled.dequantize_reduce_quantize(chunks, scales, 4, 2048), want)
    assert calls == [1, 1]


def test_build_is_cached_and_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A second build reuses the cached library; a failing compiler logs once and leaves the compiled path on."""
    monkeypatch.setenv("MX_KERNELS_CACHE", str(tmp_path))
    lib = native.build("portable")
    stamp = lib.stat().st_mtime_ns
    assert native.build("portable") == lib and lib.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary file left behind

    monkeypatch.setenv("MX_KERNELS_CACHE", str(tmp_path / "broken"))
    monkeypatch.setenv("CC", "false")
    native.library.cache_clear()
    native._vector_build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert native.library("native") is None and not native.available()
            assert native.library("native") is None
        assert [r.getMessage().count("not available") for r in caplog.records] == [1]
        with pytest.raises(RuntimeError, match="could not be built"):
            native.int4_reduce_quantize(*_chunks(2, 1, 64, 0), 64)
        chunks, scales = _chunks(2, 3, 64, 0)
        with compiled.use_compile("1"):
            _same(compiled.dequantize_reduce_quantize(chunks, scales, 4, 64),
                  ref.dequantize_reduce_quantize(chunks, scales, 4, 64))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
        native._vector_build.cache_clear()


# ----------------------------------------------------------------------------------------------------------------
# The fp32 codecs (csrc/codec.c)
# ----------------------------------------------------------------------------------------------------------------
def _data(numel, seed):
    """fp32 data over many magnitudes, with all-zero groups (absmax 0) where there is room."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(3) * 8
    x[7:200] = 0.0
    return x


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 6, 7, 64, 2048]), numel=st.integers(0, 5000),
       pad=st.integers(0, 2), threads=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_codec_quantize_dequantize(variant, bits, group, numel, pad, threads, seed):
    if bits == 4 and group % 2:
        group += 1
    x = _data(numel, seed)
    groups = -(-numel // group) + pad  # whole padding groups beyond the data: qgZ's short or empty stage chunks
    want_codes = torch.empty(groups * group * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
    want_scales = torch.empty(groups)
    ref._quantize_padded(x, numel, bits, group, want_codes, want_scales)
    codes, scales = torch.full_like(want_codes, 0x5A), torch.full_like(want_scales, float("nan"))  # every byte set
    native.quantize_into(x, bits, group, codes, scales, threads=threads, variant=variant)
    _same((codes, scales), (want_codes, want_scales))
    got = native.dequantize_reduce(codes.view(1, -1), scales.view(1, -1), bits, group, numel, threads=threads,
                                   variant=variant)
    _same((got,), (ref.dequantize_symmetric(codes, scales, bits=bits, group_size=group, numel=numel),))


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(k=st.integers(1, 9), bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 6, 64, 2048]),
       groups=st.integers(1, 9), cut=st.integers(0, 70), threads=st.integers(1, 3), seed=st.integers(0, 2 ** 16),
       factor=st.sampled_from([1.0, 1 / 3, 0.125, 1 / 48]))
def test_codec_dequantize_reduce(variant, k, bits, group, groups, cut, threads, seed, factor):
    qs = [ref.quantize_symmetric(_data(groups * group, seed + i), bits=bits, group_size=group) for i in range(k)]
    chunks, scales = torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])
    numel = max(0, groups * group - cut)
    _same((native.dequantize_reduce(chunks, scales, bits, group, numel, factor, threads=threads, variant=variant),),
          (ref.dequantize_reduce(chunks, scales, bits=bits, group_size=group, numel=numel, factor=factor),))


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(chunk=st.sampled_from([1, 7, 48, 2048]), numel=st.integers(1, 9000), offset=st.sampled_from([0.0, 0.5, -3.0]),
       threads=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_codec_minmax_dequantize(variant, chunk, numel, offset, threads, seed):
    q, mins, maxs = ref.quantize_minmax_uint8(_data(numel, seed) + offset, chunk)
    scale, lb = compiled._minmax_params(mins, maxs)
    _same((native.dequantize_minmax(q, scale, lb, chunk, numel, threads=threads, variant=variant),),
          (ref.dequantize_minmax_uint8(q, mins, maxs, chunk, numel),))


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(k=st.integers(1, 4), chunk=st.sampled_from([1, 7, 48, 2048, 3000]), numel=st.integers(0, 9000),
       cut=st.integers(0, 40), threads=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_codec_minmax_reduce(variant, k, chunk, numel, cut, threads, seed):
    """ByteGrad's decode-and-average over k rows of a strided buffer: threads split mid-chunk and mid-block (blocks
    of 2048 inside chunks of 3000), rows longer than numel."""
    rows = [ref.quantize_minmax_uint8(_data(numel + cut, seed + a) * (a + 1), chunk) for a in range(k)]
    q = torch.stack([torch.cat([r[0], torch.zeros(5, dtype=torch.uint8)]) for r in rows])[:, :numel + cut]
    mins, maxs = torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows])
    nchunks = -(-numel // chunk)
    scale, lb = compiled._minmax_params(mins[:, :nchunks], maxs[:, :nchunks])
    factor = 1.0 / (k * 3)
    _same((native.dequantize_minmax_reduce(q, scale, lb, chunk, numel, factor, threads=threads, variant=variant),),
          (ref.dequantize_minmax_reduce(q, mins, maxs, chunk, numel, factor=factor),))


@pytest.mark.parametrize("variant", VARIANTS)
def test_codec_ties_and_subnormal_scales(variant):
    """Half-to-even ties (contract_cases' hand-written codes) and subnormal scales, where the clamp bites."""
    for bits, xs, group, want_codes, want_scales in (
            (8, contract_cases.INT8_TIE_X, 16, contract_cases.INT8_TIE_CODES, contract_cases.INT8_TIE_SCALES),
            (4, contract_cases.INT4_TIE_X, 8, contract_cases.INT4_TIE_BYTES, contract_cases.INT4_TIE_SCALES)):
        x = torch.tensor(xs)
        codes = torch.empty(x.numel() * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
        scales = torch.empty(x.numel() // group)
        native.quantize_into(x, bits, group, codes, scales, variant=variant)
        assert codes.tolist() == want_codes and scales.tolist() == want_scales
    x = torch.tensor([1e-40, -3e-41, 2e-42, 0.0, 5e-39, -5e-39, 1e-45, 0.0] * 8 + [0.0] * 64 + [1.0, -2.0] * 32)
    for bits in (8, 4):
        want = ref.quantize_symmetric(x, bits=bits, group_size=64)
        got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
        native.quantize_into(x, bits, 64, *got, variant=variant)
        _same(got, want)


@pytest.mark.parametrize("bits,group,numel", [(4, 64, 763), (8, 6, 763), (8, 2048, 600_001), (4, 2048, 600_001)])
def test_compiled_entry_points_use_the_codecs(monkeypatch, bits, group, numel):
    """With the vector build here, the compiled path's fp32 ops run the codecs at every size (and only fp32: other
    dtypes take Inductor's loops or the reference); MX_KERNELS_NATIVE=0 or eager mode turn them off. Same bits.
    600k elements: two threads by default, a partial last group."""
    if not native.available():
        pytest.skip("no AVX-512 or AVX2 here: the compiled path runs Inductor's loops")
    calls = []
    for name in ("quantize_into", "dequantize_reduce", "dequantize_minmax"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    x = _data(numel, numel)  # a qgZ bucket over 3 nodes x 2 ranks, 2 stages: short last partition

    def run_all():
        out = [compiled.quantize_symmetric(x, bits=bits, group_size=group),
               compiled.swizzle_quantize(x, bits, group, 3, 2, 2)]
        codes, scales = out[0]
        out.append(compiled.dequantize_symmetric(codes, scales, bits=bits, group_size=group, numel=x.numel()))
        chunks, sc = torch.stack([codes, codes]), torch.stack([scales, scales * 2])
        out.append(compiled.dequantize_reduce(chunks, sc, bits=bits, group_size=group, numel=x.numel() - 3))
        q, mins, maxs = compiled.quantize_minmax_uint8(x, 100)
        out.append(compiled.dequantize_minmax_uint8(q, mins, maxs, 100, x.numel()))
        return out

    want = [ref.quantize_symmetric(x, bits=bits, group_size=group), ref.swizzle_quantize(x, bits, group, 3, 2, 2)]
    want.append(ref.dequantize_symmetric(*want[0], bits=bits, group_size=group, numel=x.numel()))
    want.append(ref.dequantize_reduce(torch.stack([want[0][0]] * 2), torch.stack([want[0][1], want[0][1] * 2]),
                                      bits=bits, group_size=group, numel=x.numel() - 3))
    want.append(ref.dequantize_minmax_uint8(*ref.quantize_minmax_uint8(x, 100), 100, x.numel()))
    # quantize, the 12 stage chunks of the swizzle, dequantize, the reduce, min-max dequantize
    every = ["quantize_into"] * 13 + ["dequantize_reduce"] * 2 + ["dequantize_minmax"]
    for mode, native_on, expect in (("auto", "1", every), ("1", "1", every), ("0", "1", []), ("1", "0", [])):
        calls.clear()
        monkeypatch.setenv("MX_KERNELS_NATIVE", native_on)
        with compiled.use_compile(mode), monkeypatch.context() as m:
            if native_on == "0":   # the routing is under test here; Inductor's loops have their bits in test_compiled
                m.setattr(compiled, "_compiled", lambda core: core)
            for got, w in zip(run_all(), want):
                _same(got if isinstance(got, tuple) else (got,), w if isinstance(w, tuple) else (w,))
        assert calls == expect, (mode, native_on)
    monkeypatch.setenv("MX_KERNELS_NATIVE", "1")
    calls.clear()
    with compiled.use_compile("auto"):
        compiled.dequantize_symmetric(*want[0], bits=bits, group_size=group, numel=x.numel(), dtype=torch.bfloat16)
        compiled.quantize_symmetric(x[:1000].bfloat16(), bits=8, group_size=64)
    assert calls == []


def test_codecs_take_only_cpu_memory():
    """Every tensor whose memory the C reads is checked, not only the one that picked the backend: codes on another
    device beside CPU scales (or an fp16 one among them) never reach it."""
    cpu8, f32 = torch.zeros(64, dtype=torch.int8), torch.zeros(8)
    assert compiled._native(cpu8, f32) == native.available()
    assert not compiled._native(torch.zeros(64, dtype=torch.int8, device="meta"), f32)
    assert not compiled._native(cpu8, f32.to(device="meta"))
    assert not compiled._native(cpu8, f32.half())


def test_codec_contract_cases(monkeypatch):
    """The hand-written ties and the overflowing min-max chunk through the compiled path's entry points."""
    if not native.available():
        pytest.skip("no AVX-512 or AVX2 here: the compiled path runs Inductor's loops")
    monkeypatch.setenv("MX_KERNELS_NATIVE", "1")
    with compiled.use_compile("auto"):
        contract_cases.run_symmetric_ties(compiled)
        contract_cases.run_swizzle_ties(compiled)
        contract_cases.run_non_contiguous_rejected(compiled)
        contract_cases.run_row_strided_inputs(compiled)
        contract_cases.run_out_rows(compiled)
        contract_cases.run_bad_arguments_rejected(compiled)
        contract_cases.run_minmax_overflow(compiled)
        contract_cases.run_minmax_reduce(compiled)
        contract_cases.run_minmax_rows(compiled)
        contract_cases.run_reduce_factor_out(compiled)
        contract_cases.run_minmax_out_rows(compiled)
        contract_cases.run_out_aliasing_rejected(compiled)
