"""The hand-written INT4 dequantize-reduce-requantize (:mod:`megatron_ext.kernels.native`) equals the eager reference
bit for bit: the vector build (this CPU: AVX-512 or AVX2), the AVX2 build where the CPU has it, and the portable build
(the scalar loop alone, which also serves every group's last bytes), any k (unrolled up to 8, a loop above), any even
group size, split over threads at any group.
"""
import logging
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.kernels import compiled, native
from megatron_ext.kernels import reference as ref

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
    group = 64
    chunks = torch.randint(0, 256, (3, 4 * group // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for bad in (float("inf"), float("nan"), 3e38):
        scales = torch.rand(3, 4, generator=torch.Generator().manual_seed(2))
        scales[1, 1] = scales[2, 2] = bad
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
