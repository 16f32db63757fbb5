"""The compiled CPU path (:mod:`megatron_ext.kernels.compiled`, torch.compile / Inductor) equals the eager torch
reference bit for bit: the hypothesis cases of ``triton_cases.py`` and the hand-written ``contract_cases``.

Compile time is what this file costs: each new bit width, dtype, group size, min-max piece width or ``k`` is one
more graph (2-20 s on a cold Inductor cache on 2 busy cores, well under 1 s from a warm one). So the graph-shaping
parameters are a fixed list of combinations, together covering both bit widths, every input and output dtype, a
group size that is not a multiple of the vector width (6) and ``k`` = 1, 2, 3; hypothesis draws what is dynamic
(sizes, padding, offsets, seeds) as in ``triton_cases.py``, and those never recompile
(``test_bucket_sizes_do_not_recompile``).
"""
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ext.kernels import compiled
from megatron_ext.kernels import reference as ref

from . import contract_cases

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class _Compiled:
    """The compiled module's functions, compiled at every size (``auto`` leaves small tensors eager)."""

    def __getattr__(self, name):
        fn = getattr(compiled, name)

        def call(*args, **kwargs):
            with compiled.use_compile("1"):
                return fn(*args, **kwargs)
        return call


@pytest.fixture(autouse=True)
def inductor_loops(monkeypatch):
    """This file tests Inductor's loops: the native fp32 codecs would serve fp32 here (test_native.py tests those);
    tests that want the native INT4 reduction set MX_KERNELS_NATIVE themselves."""
    monkeypatch.setenv("MX_KERNELS_NATIVE", "0")


@pytest.fixture(scope="module")
def comp():
    yield _Compiled()
    assert not compiled._failed, f"compiling fell back to eager for {sorted(compiled._failed)} (see the log)"


def _data(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(3) * 8
    if numel > 200:
        x[7:200] = 0.0  # all-zero groups (absmax == 0)
    return x.to(dtype)


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("bits,group,dtype,out_dtype", [(8, 64, F32, BF16), (4, 64, F32, F32), (4, 6, BF16, F16),
                                                       (8, 6, F16, F32)])
@SETTINGS
@given(numel=st.integers(1, 1500), seed=st.integers(0, 2 ** 16))
def test_symmetric_quantize_dequantize(comp, numel, seed, bits, group, dtype, out_dtype):
    x = _data(numel, dtype, seed)
    want = ref.quantize_symmetric(x, bits=bits, group_size=group)
    _same(comp.quantize_symmetric(x, bits=bits, group_size=group), want)
    kw = dict(bits=bits, group_size=group, numel=numel, dtype=out_dtype)
    _same(comp.dequantize_symmetric(*want, **kw), ref.dequantize_symmetric(*want, **kw))


@pytest.mark.parametrize("bits,group,dtype", [(8, 64, F32), (4, 6, BF16)])
@SETTINGS
@given(per=st.integers(1, 200), short=st.integers(0, 5), nodes=st.integers(1, 3), rpn=st.integers(1, 3),
       stages=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_swizzle_quantize(comp, per, short, nodes, rpn, stages, seed, bits, group, dtype):
    x = _data(max(1, per * nodes * rpn - short), dtype, seed)
    _same(comp.swizzle_quantize(x, bits, group, nodes, rpn, stages),
          ref.swizzle_quantize(x, bits, group, nodes, rpn, stages))


@pytest.mark.parametrize("native", ["auto", "0"])  # INT4 requantize: the native kernel (if built here), Inductor's
@pytest.mark.parametrize("k,bits,group,out_dtype", [(2, 4, 64, F32), (3, 8, 6, BF16), (1, 4, 6, F16)])
@SETTINGS
@given(groups=st.integers(1, 30), cut=st.integers(0, 10), seed=st.integers(0, 2 ** 16))
def test_dequantize_reduce(comp, groups, cut, seed, k, bits, group, out_dtype, native, monkeypatch):
    monkeypatch.setenv("MX_KERNELS_NATIVE", native)
    qs = [ref.quantize_symmetric(_data(groups * group, torch.float32, seed + i), bits=bits, group_size=group)
          for i in range(k)]
    chunks, scales = torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])
    _same(comp.dequantize_reduce_quantize(chunks, scales, bits, group),
          ref.dequantize_reduce_quantize(chunks, scales, bits, group))
    kw = dict(bits=bits, group_size=group, numel=max(1, groups * group - cut), dtype=out_dtype)
    _same(comp.dequantize_reduce(chunks, scales, **kw), ref.dequantize_reduce(chunks, scales, **kw))


@pytest.mark.parametrize("chunk,dtype,out_dtype", [(2048, F32, F32), (48, BF16, F16), (7, F16, BF16)])
@SETTINGS
@given(numel=st.integers(1, 9000), offset=st.sampled_from([0.0, 0.5, -3.0]), seed=st.integers(0, 2 ** 16))
def test_minmax(comp, numel, offset, seed, chunk, dtype, out_dtype):
    x = (_data(numel, torch.float32, seed) + offset).to(dtype)
    want = ref.quantize_minmax_uint8(x, chunk)
    _same(comp.quantize_minmax_uint8(x, chunk), want)
    _same(comp.dequantize_minmax_uint8(*want, chunk, numel, out_dtype),
          ref.dequantize_minmax_uint8(*want, chunk, numel, out_dtype))


def test_minmax_tie_clamp(comp):
    """Ties at both ends of every chunk (see test_reference); chunks of 48 are tiled by pieces of 16."""
    x = torch.tensor([-1.0, 0.0, 0.25, 1.0] * 36, dtype=torch.bfloat16)
    _same(comp.quantize_minmax_uint8(x, 48), ref.quantize_minmax_uint8(x, 48))


def test_minmax_overflowing_chunks(comp):
    """Constant chunks beyond ~1.33e29 overflow max * scale (run_minmax_overflow's case, here at the chunk of 48 and
    the dtypes the hypothesis cases compile, so a compiled graph meets it rather than the eager fallback): codes 0,
    decoded +-inf; the chunks after them decode as the reference's."""
    x = torch.linspace(-1, 1, 149).to(torch.bfloat16)
    x[:48], x[48:96] = 2e29, -2e29
    want = ref.quantize_minmax_uint8(x, 48)
    got = comp.quantize_minmax_uint8(x, 48)
    _same(got, want)
    assert got[0][:96].eq(0).all()
    y = comp.dequantize_minmax_uint8(*got, 48, 149, torch.float16)
    _same(y, ref.dequantize_minmax_uint8(*want, 48, 149, torch.float16))
    assert y[:48].eq(float("inf")).all() and y[48:96].eq(float("-inf")).all() and y[96:].isfinite().all()


def test_subnormal_and_zero_groups(comp):
    x = torch.tensor([1e-40, -3e-41, 2e-42, 0.0, 5e-39, -5e-39, 1e-45, 0.0] * 8 + [0.0] * 64 + [1.0, -2.0] * 32)
    for bits in (8, 4):
        _same(comp.quantize_symmetric(x, bits=bits, group_size=64),
              ref.quantize_symmetric(x, bits=bits, group_size=64))


def test_contract_cases(comp):
    """Hand-written ties (half to even), strided inputs rejected, the overflowing min-max chunk."""
    contract_cases.run_symmetric_ties(comp)
    contract_cases.run_swizzle_ties(comp)
    contract_cases.run_requantize_ties(comp)
    contract_cases.run_non_contiguous_rejected(comp)
    contract_cases.run_row_strided_inputs(comp)
    contract_cases.run_out_rows(comp)
    contract_cases.run_bad_arguments_rejected(comp)
    contract_cases.run_minmax_overflow(comp)
    contract_cases.run_minmax_reduce(comp)
    contract_cases.run_minmax_rows(comp)
    contract_cases.run_reduce_factor_out(comp)
    contract_cases.run_minmax_out_rows(comp)
    contract_cases.run_out_aliasing_rejected(comp)


def test_production_group_size_2048(comp):
    """qwZ/qgZ default group (fp32, as the benchmark): padded lengths, odd swizzle offsets, INT4 k = 2 reductions;
    and min-max chunks of 2048 over a partial last chunk (test_minmax's 2048 case draws no example long enough to
    compile: its hypothesis examples all stay under two chunks)."""
    g = 2048
    x = _data(3 * g + 777, torch.float32, 7)
    want = ref.quantize_minmax_uint8(x, g)
    _same(comp.quantize_minmax_uint8(x, g), want)
    _same(comp.dequantize_minmax_uint8(*want, g, x.numel(), torch.float32),
          ref.dequantize_minmax_uint8(*want, g, x.numel(), torch.float32))
    for bits in (8, 4):
        for numel in (3 * g + 777, 2 * g):
            dtype = torch.float32
            x = _data(numel, dtype, numel + bits)
            want = ref.quantize_symmetric(x, bits=bits, group_size=g)
            _same(comp.quantize_symmetric(x, bits=bits, group_size=g), want)
            kw = dict(bits=bits, group_size=g, numel=numel, dtype=dtype)
            _same(comp.dequantize_symmetric(*want, **kw), ref.dequantize_symmetric(*want, **kw))
        x = _data(2 * 3 * 2 * g - 3, torch.float32, bits)  # 2 nodes x 3 ranks, 2 stages: odd partition offsets
        _same(comp.swizzle_quantize(x, bits, g, 2, 3, 2), ref.swizzle_quantize(x, bits, g, 2, 3, 2))
        if bits == 8:
            continue
        qs = [ref.quantize_symmetric(_data(3 * g, torch.float32, 10 + i), bits=bits, group_size=g) for i in range(2)]
        chunks, scales = torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])
        _same(comp.dequantize_reduce_quantize(chunks, scales, bits, g),
              ref.dequantize_reduce_quantize(chunks, scales, bits, g))
        kw = dict(bits=bits, group_size=g, numel=3 * g - 1000)
        _same(comp.dequantize_reduce(chunks, scales, **kw), ref.dequantize_reduce(chunks, scales, **kw))


def test_bucket_sizes_do_not_recompile(comp):
    """The number of groups is dynamic: once compiled, other bucket sizes (and slices at other offsets) reuse it."""
    from torch._dynamo.utils import counters
    comp.quantize_symmetric(_data(64 * 5, torch.float32, 0), bits=8, group_size=64)
    before = counters["stats"]["unique_graphs"]
    for numel in (64 * 3, 64 * 40 + 5, 64 * 1000):
        x = _data(numel, torch.float32, numel)
        _same(comp.quantize_symmetric(x, bits=8, group_size=64), ref.quantize_symmetric(x, bits=8, group_size=64))
    assert counters["stats"]["unique_graphs"] == before


def test_compile_failure_falls_back_once(monkeypatch, caplog):
    """A compiler error logs one warning per op and runs the same core eagerly: same bits, no exception."""
    def broken(core):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail
    monkeypatch.setattr(compiled, "_compiled", broken)
    monkeypatch.setattr(compiled, "_failed", set())
    x = _data(64 * 9 + 3, torch.bfloat16, 5)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__), compiled.use_compile("1"):
        for _ in range(2):
            _same(compiled.quantize_symmetric(x, bits=4, group_size=64),
                  ref.quantize_symmetric(x, bits=4, group_size=64))
    assert [r.getMessage().count("no C++ compiler") for r in caplog.records] == [1]
    assert compiled._failed == {"quantize"}


def test_dispatch_mode_runs_eager_for_that_call_only(monkeypatch, caplog):
    """Under a TorchDispatchMode (what an op counter or FlopCounterMode pushes) Dynamo refuses to compile. The call
    runs the core eagerly -- same bits, no warning -- and the op is not marked failed: outside the mode it compiles
    again. (It used to fail, log, and leave ByteGrad's quantizer eager for the rest of the process after
    tools/bucket_overhead.py's op-counting pass.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    compiles = []
    monkeypatch.setattr(compiled, "_compiled", lambda core: compiles.append(core) or core)
    monkeypatch.setattr(compiled, "_failed", set())
    x = _data(64 * 9, torch.float32, 6)
    want = ref.quantize_symmetric(x, bits=8, group_size=64)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__), compiled.use_compile("1"):
        with Count():
            _same(compiled.quantize_symmetric(x, bits=8, group_size=64), want)
        assert compiles == [] and Count.n > 0
        _same(compiled.quantize_symmetric(x, bits=8, group_size=64), want)
    assert len(compiles) == 1 and not compiled._failed and not caplog.records


def test_compile_modes(monkeypatch):
    """MX_KERNELS_COMPILE: 0 runs the reference, auto compiles from MIN_NUMEL elements, bad values are errors."""
    calls = []
    monkeypatch.setattr(compiled, "_run", lambda *a: calls.append(a[0]))
    x = torch.randn(256)
    for mode, min_numel, expect in (("0", 1, []), ("auto", 257, []), ("auto", 256, ["quantize"]),
                                    ("1", 10 ** 9, ["quantize"])):
        calls.clear()
        monkeypatch.setenv("MX_KERNELS_COMPILE", mode)
        monkeypatch.setattr(compiled, "MIN_NUMEL", min_numel)
        compiled.quantize_symmetric(x, bits=8, group_size=64)
        assert calls == expect, mode
    monkeypatch.setenv("MX_KERNELS_COMPILE", "yes")
    with pytest.raises(ValueError, match="MX_KERNELS_COMPILE"):
        compiled.quantize_symmetric(x, bits=8, group_size=64)


def test_reduce_tails_give_the_same_bits(comp):
    """dequantize_reduce: one call over the whole groups plus the partial last group; one whole group runs eager."""
    qs = [ref.quantize_symmetric(_data(9 * 64, torch.float32, 20 + i), bits=4, group_size=64) for i in range(2)]
    chunks, scales = torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])
    _same(comp.dequantize_reduce_quantize(chunks, scales, 4, 64), ref.dequantize_reduce_quantize(chunks, scales, 4, 64))
    for numel in (9 * 64, 9 * 64 - 70, 64 + 5, 40):
        kw = dict(bits=4, group_size=64, numel=numel)
        _same(comp.dequantize_reduce(chunks, scales, **kw), ref.dequantize_reduce(chunks, scales, **kw))
