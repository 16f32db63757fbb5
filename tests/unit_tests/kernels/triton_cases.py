"""Each Triton kernel equals its torch reference bit for bit: on CPU tensors under ``TRITON_INTERPRET=1``, or compiled
on a GPU with ``MX_TEST_DEVICE=cuda``.

Not collected by default (no ``test_`` prefix): ``test_triton_interpreted.py`` runs this file in a fresh pytest
subprocess with ``TRITON_INTERPRET=1`` set before anything imports Triton (see the note there). On a machine with a
GPU, ``MX_TEST_DEVICE=cuda python -m pytest tests/unit_tests/kernels/triton_cases.py`` runs the same cases on the
compiled kernels: inputs are built on the CPU as always, moved to the GPU with their exact strides, and the results
come back to be compared with the CPU reference.
"""
import os
import re

import pytest
import torch

DEVICE = os.environ.get("MX_TEST_DEVICE", "cpu")
if DEVICE == "cuda":
    if not torch.cuda.is_available():
        pytest.skip("MX_TEST_DEVICE=cuda but CUDA is not available", allow_module_level=True)
elif os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpreted.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)
pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_ext.kernels import reference as ref  # noqa: E402

from . import contract_cases  # noqa: E402

# the interpreter runs every program in Python: few examples there (as many as the Inductor path's cases in
# test_compiled.py); compiled kernels afford many more
SETTINGS = settings(max_examples=60 if DEVICE == "cuda" else 8, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _to_device(t, storages: dict):
    """``t`` on DEVICE with the same storage layout (size, strides, offset): a strided view stays strided, and
    tensors that share a CPU storage share one device copy of it (``storages``, one per call): an ``out=(codes,
    scales)`` pair of wire rows stays one buffer, and an ``out`` aliasing the input still aliases it."""
    if isinstance(t, tuple):
        return tuple(_to_device(v, storages) for v in t)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":   # meta: a device-mismatch case, kept as it is
        return t
    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())   # one allocation: same start and size
    if key not in storages:
        storages[key] = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).to(DEVICE).untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=DEVICE).set_(storages[key], t.storage_offset(), t.size(), t.stride())


def _to_cpu(out):
    return tuple(_to_cpu(o) for o in out) if isinstance(out, tuple) else out.cpu()


class _OnDevice:
    """The Triton launchers with CPU tensors in and out, the kernels running on DEVICE."""

    def __init__(self, impl):
        self._impl = impl

    def __getattr__(self, name):
        fn = getattr(self._impl, name)

        def call(*args, **kwargs):
            storages = {}
            dev_args = [_to_device(a, storages) for a in args]
            dev_kwargs = {k: _to_device(v, storages) for k, v in kwargs.items()}
            try:
                out = fn(*dev_args, **dev_kwargs)
            except (ValueError, TypeError) as e:   # the cases expect the device their CPU tensors name
                raise type(e)(re.sub(r"\bcuda(:\d+)?", "cpu", str(e))) from e
            torch.cuda.synchronize()
            if "out" in kwargs:   # an op writing into ``out``: copy its whole storage back (what it must not touch too)
                dst, src = kwargs["out"], dev_kwargs["out"]
                pair = isinstance(dst, tuple)
                for d, s in zip(dst, src) if pair else ((dst, src),):
                    torch.empty(0, dtype=torch.uint8).set_(d.untyped_storage()).copy_(
                        torch.empty(0, dtype=torch.uint8, device=s.device).set_(s.untyped_storage()))
                if pair:   # the op returns the out views themselves
                    assert all(o is v for o, v in zip(out, src))
                    return dst
                return dst if out is src else _to_cpu(out)
            return _to_cpu(out)
        return call


@pytest.fixture(scope="module")
def tri():
    from megatron_ext.kernels import triton_ops, triton_symmetric
    if DEVICE == "cuda":
        return _OnDevice(triton_ops)
    from triton.runtime.interpreter import InterpretedFunction
    assert isinstance(triton_symmetric.swizzle_quantize_kernel, InterpretedFunction)
    return triton_ops


def _data(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(3) * 8
    if numel > 40:
        x[7:40] = 0.0  # an all-zero group for small group sizes
    return x.to(dtype)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                       b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)


@SETTINGS
@given(numel=st.integers(1, 1500), bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 6, 32, 64, 100, 256]),
       dtype=DTYPES, out_dtype=DTYPES, seed=st.integers(0, 2 ** 16))
def test_symmetric_quantize_dequantize(tri, numel, bits, group, dtype, out_dtype, seed):
    _check_symmetric(tri, _data(numel, dtype, seed), bits, group, out_dtype)


def _check_symmetric(tri, x, bits, group, out_dtype):
    """Triton quantize and dequantize equal the torch reference bit for bit (codes, scales, decoded values)."""
    want = ref.quantize_symmetric(x, bits=bits, group_size=group)
    got = tri.quantize_symmetric(x, bits=bits, group_size=group)
    _same(got[0], want[0])
    _same(got[1], want[1])
    kw = dict(bits=bits, group_size=group, numel=x.numel(), dtype=out_dtype)
    _same(tri.dequantize_symmetric(*want, **kw), ref.dequantize_symmetric(*want, **kw))


@SETTINGS
@given(per=st.integers(1, 200), short=st.integers(0, 5), nodes=st.integers(1, 3), rpn=st.integers(1, 3),
       stages=st.integers(1, 3), bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 8, 32, 34]), dtype=DTYPES,
       seed=st.integers(0, 2 ** 16))
def test_swizzle_quantize(tri, per, short, nodes, rpn, stages, bits, group, dtype, seed):
    numel = max(1, per * nodes * rpn - short)
    x = _data(numel, dtype, seed)
    want = ref.swizzle_quantize(x, bits, group, nodes, rpn, stages)
    got = tri.swizzle_quantize(x, bits, group, nodes, rpn, stages)
    _same(got[0], want[0])
    _same(got[1], want[1])


@SETTINGS
@given(k=st.integers(1, 5), groups=st.integers(1, 30), bits=st.sampled_from([8, 4]),
       group=st.sampled_from([2, 6, 32, 64]), out_dtype=DTYPES, cut=st.integers(0, 10), seed=st.integers(0, 2 ** 16))
def test_dequantize_reduce(tri, k, groups, bits, group, out_dtype, cut, seed):
    xs = [_data(groups * group, torch.float32, seed + i) for i in range(k)]
    qs = [ref.quantize_symmetric(x, bits=bits, group_size=group) for x in xs]
    chunks = torch.stack([c for c, _ in qs])
    scales = torch.stack([s for _, s in qs])
    want = ref.dequantize_reduce_quantize(chunks, scales, bits, group)
    got = tri.dequantize_reduce_quantize(chunks, scales, bits, group)
    _same(got[0], want[0])
    _same(got[1], want[1])
    numel = max(1, groups * group - cut)
    kw = dict(bits=bits, group_size=group, numel=numel, dtype=out_dtype)
    _same(tri.dequantize_reduce(chunks, scales, **kw), ref.dequantize_reduce(chunks, scales, **kw))


@SETTINGS
@given(numel=st.integers(1, 5000), chunk=st.sampled_from([1, 7, 100, 1000, 2048, 2049, 100000]), dtype=DTYPES,
       out_dtype=DTYPES, offset=st.sampled_from([0.0, 0.5, -3.0]), seed=st.integers(0, 2 ** 16))
def test_minmax(tri, numel, chunk, dtype, out_dtype, offset, seed):
    numel = min(numel, 20 * chunk)  # at most 20 chunks: the interpreter runs one program per (chunk, block)
    x = (_data(numel, torch.float32, seed) + offset).to(dtype)
    want = ref.quantize_minmax_uint8(x, chunk)
    got = tri.quantize_minmax_uint8(x, chunk)
    for a, b in zip(got, want):
        _same(a, b)
    _same(tri.dequantize_minmax_uint8(*want, chunk, numel, out_dtype),
          ref.dequantize_minmax_uint8(*want, chunk, numel, out_dtype))


def test_minmax_tie_clamp(tri):
    x = torch.tensor([-1.0, 0.0, 0.25, 1.0])  # ties at both ends: see test_reference
    for a, b in zip(tri.quantize_minmax_uint8(x, 4), ref.quantize_minmax_uint8(x, 4)):
        _same(a, b)


def test_subnormal_and_zero_groups(tri):
    x = torch.tensor([1e-40, -3e-41, 2e-42, 0.0, 5e-39, -5e-39, 1e-45, 0.0] + [0.0] * 8 + [1.0, -2.0] * 4)
    for bits in (8, 4):
        want = ref.quantize_symmetric(x, bits=bits, group_size=8)
        got = tri.quantize_symmetric(x, bits=bits, group_size=8)
        _same(got[0], want[0])
        _same(got[1], want[1])


def test_non_contiguous_rejected(tri):
    x = torch.randn(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        tri.quantize_symmetric(x, bits=8, group_size=8)
    with pytest.raises(ValueError, match="contiguous"):
        tri.swizzle_quantize(x, 8, 8, 2, 2, 1)
    with pytest.raises(ValueError, match="contiguous"):
        tri.quantize_minmax_uint8(x, 8)
    contract_cases.run_non_contiguous_rejected(tri)  # the same errors as the torch path (test_reference)
    contract_cases.run_row_strided_inputs(tri)
    contract_cases.run_bad_arguments_rejected(tri)
    contract_cases.run_out_rows(tri)


def test_round_half_to_even_ties(tri):
    """Exact .5 ties, hand-written codes: plain quantize, the fused swizzle and the fused requantize."""
    contract_cases.run_symmetric_ties(tri)
    contract_cases.run_swizzle_ties(tri)
    contract_cases.run_requantize_ties(tri)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, interpreting max*scale -> inf and inf - inf
def test_minmax_overflowing_constant_chunk(tri):
    contract_cases.run_minmax_overflow(tri)
    contract_cases.run_minmax_reduce(tri)
    contract_cases.run_minmax_rows(tri)
    contract_cases.run_minmax_out_rows(tri)
    contract_cases.run_out_aliasing_rejected(tri)


def test_reduce_factor_and_out(tri):
    """qgZ's last step: the averaging factor and the shard as out."""
    contract_cases.run_reduce_factor_out(tri)


def test_production_group_size_2048(tri):
    """qwZ/qgZ default group (comm quant_group_size=2048): lengths that are not a multiple of it, every op."""
    g = 2048
    for bits in (8, 4):
        for numel, dtype in ((2 * g + 777, torch.float32), (g - 3, torch.bfloat16)):
            _check_symmetric(tri, _data(numel, dtype, numel + bits), bits, g, dtype)
        x = _data(3 * g + 5, torch.float32, bits)  # 2 nodes x 1 rank x 2 stages: four padded chunks of one group
        for a, b in zip(tri.swizzle_quantize(x, bits, g, 2, 1, 2), ref.swizzle_quantize(x, bits, g, 2, 1, 2)):
            _same(a, b)
        qs = [ref.quantize_symmetric(_data(2 * g, torch.float32, 10 + i), bits=bits, group_size=g) for i in range(3)]
        chunks, scales = torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])
        for a, b in zip(tri.dequantize_reduce_quantize(chunks, scales, bits, g),
                        ref.dequantize_reduce_quantize(chunks, scales, bits, g)):
            _same(a, b)
        kw = dict(bits=bits, group_size=g, numel=2 * g - 1000)
        _same(tri.dequantize_reduce(chunks, scales, **kw), ref.dequantize_reduce(chunks, scales, **kw))


def test_int32_offset_guard_is_checked_by_every_launcher(tri, monkeypatch):
    """Each launcher refuses before launching when its offsets would pass the int32 limit (lowered here so that a
    small tensor trips it; the limit itself is tested in test_reference)."""
    from megatron_ext.kernels import layout
    x = torch.randn(4096)
    codes, scales = ref.quantize_symmetric(x, bits=8, group_size=64)
    q, mins, maxs = ref.quantize_minmax_uint8(x, 1024)
    calls = [lambda: tri.quantize_symmetric(x, bits=8, group_size=64),
             lambda: tri.swizzle_quantize(x, 4, 64, 2, 2, 1),
             lambda: tri.dequantize_symmetric(codes, scales, bits=8, group_size=64, numel=4096),
             lambda: tri.dequantize_reduce_quantize(codes.view(2, -1), scales.view(2, -1), 8, 64),
             lambda: tri.dequantize_reduce(codes.view(2, -1), scales.view(2, -1), bits=8, group_size=64),
             lambda: tri.quantize_minmax_uint8(x, 1024),
             lambda: tri.dequantize_minmax_uint8(q, mins, maxs, 1024, 4096),
             lambda: tri.dequantize_minmax_reduce(q.view(2, -1), mins.view(2, -1), maxs.view(2, -1), 1024, 2048),
             lambda: tri.dequantize_rows(codes.view(2, -1), scales.view(2, -1), bits=8, group_size=64,
                                         out=torch.empty(2, 2048)),
             lambda: tri.dequantize_minmax_rows(q.view(1, -1), mins.view(1, -1), maxs.view(1, -1), 1024,
                                                out=torch.empty(1, 4096))]
    monkeypatch.setattr(layout, "INT32_OFFSET_LIMIT", 4000)
    for call in calls:
        with pytest.raises(ValueError, match="int32"):
            call()
    monkeypatch.setattr(layout, "INT32_OFFSET_LIMIT", 1 << 16)  # a limit above the extents: every call runs
    for call in calls:
        call()


def test_a_repeated_launch_runs_the_compiled_binary(tri):
    """On a GPU the second launch of a signature calls the binary the first one compiled (kernels/triton_launch.py),
    with the same result; under the interpreter every launch is a JIT call."""
    from megatron_ext.kernels import triton_ops
    if DEVICE != "cuda":
        assert not triton_ops._reduce._fast
        return
    codes, scales = ref.quantize_symmetric(_data(8192, torch.float32, 4), bits=4, group_size=64)
    chunks, sc = codes.view(4, -1), scales.view(4, -1)
    triton_ops._reduce._compiled.clear()
    first = tri.dequantize_reduce_quantize(chunks, sc, 4, 64)   # JIT call: compiles or finds the binary
    entries = list(triton_ops._reduce._compiled.values())
    assert len(entries) == 1 and isinstance(entries[0], tuple), entries   # the binary, armed for reuse
    second = tri.dequantize_reduce_quantize(chunks, sc, 4, 64)
    assert len(triton_ops._reduce._compiled) == 1
    for a, b in zip(first, second):
        _same(a, b)


def test_int32_offset_guard_counts_the_out_row_stride(tri, monkeypatch):
    """Rows of ``out`` far apart form larger offsets than the same rows side by side: past the (lowered) int32 limit
    the launch is refused, below it the op runs."""
    from megatron_ext.kernels import layout
    x = torch.randn(4096)
    codes, scales = ref.quantize_symmetric(x, bits=8, group_size=64)
    monkeypatch.setattr(layout, "INT32_OFFSET_LIMIT", 1 << 16)
    for stride, fits in ((2048, True), (70000, False)):   # bytes between the two rows of codes
        out = torch.empty(2 * stride, dtype=torch.int8).as_strided((2, 2048), (stride, 1)), torch.empty(2, 32)
        out2 = out[0][:, :1024], out[1][:, :16]
        out3 = out[0].view(torch.uint8), torch.empty(2, 2), torch.empty(2, 2)   # ByteGrad: 2 chunks of 1024 a row
        for call in (lambda: tri.quantize_symmetric(x, bits=8, group_size=64, out=out),
                     lambda: tri.dequantize_reduce_quantize(codes.view(2, -1), scales.view(2, -1), 8, 64, out=out2),
                     lambda: tri.quantize_minmax_uint8(x, 1024, out=out3)):
            if fits:
                call()
            else:
                with pytest.raises(ValueError, match="int32"):
                    call()


def test_minmax_row_decode_takes_rows_any_distance_apart(tri, monkeypatch):
    """The row decode's rows are offset in int64 (grid axis 1): rows of codes and of ``out`` further apart than the
    (lowered) int32 limit decode, to the values of rows side by side; only a row's own extent is checked."""
    from megatron_ext.kernels import layout
    x = torch.randn(4096)
    q, mins, maxs = ref.quantize_minmax_uint8(x, 1024)
    want = torch.empty(2, 2048)
    tri.dequantize_minmax_rows(q.view(2, -1), mins.view(2, -1), maxs.view(2, -1), 1024, out=want)
    monkeypatch.setattr(layout, "INT32_OFFSET_LIMIT", 1 << 16)
    far_q = torch.empty(2 * 70000, dtype=torch.uint8).as_strided((2, 2048), (70000, 1))
    far_q.copy_(q.view(2, -1))
    far_out = torch.empty(2 * 70000).as_strided((2, 2048), (70000, 1))
    assert tri.dequantize_minmax_rows(far_q, mins.view(2, -1), maxs.view(2, -1), 1024, out=far_out) is far_out
    assert torch.equal(far_out, want)
    with pytest.raises(ValueError, match="int32"):   # one row longer than the limit is refused
        tri.dequantize_minmax_rows(torch.zeros(1, 70000, dtype=torch.uint8), torch.zeros(1, 1), torch.ones(1, 1),
                                   70000, out=torch.empty(1, 70000))


def test_backends_end_to_end_through_the_triton_launchers(tri):
    """qgZ, ByteGrad and qwZ at DP 4 on 2 simulated nodes with every kernel on the Triton launchers give the bytes of
    the reference path: the in-place wire rows (quantized into the rows sent, decoded where received) through the
    backends' own code. Interpreted on CPU ranks here; the ranks are CPU processes, so a GPU run skips it."""
    if DEVICE == "cuda":
        pytest.skip("the ranks are gloo CPU processes")
    from unit_tests.comm._worlds import kernels_both_ways
    from unit_tests.dist_harness import run_distributed
    opts = dict(quant_group_size=32, bytegrad_chunk_size=32)   # ByteGrad: both rows in one call
    for rank, res in enumerate(run_distributed(kernels_both_ways, 4, 2, 64, 7, opts, timeout=300)):
        labels = {label for label, _ in res}
        assert len(labels) == 7
        for label in labels:
            a, b = res[(label, "triton")], res[(label, "torch")]
            assert not torch.isnan(b).any() and torch.equal(a.view(torch.int32), b.view(torch.int32)), (rank, label)


def test_dequantize_rows_in_blocks_of_grid_rows(tri, monkeypatch):
    """More rows than one launch's grid axis 1 may hold (CUDA: 65535; lowered to 1 here): launched in blocks, the
    same bits (run_row_strided_inputs has 2 and 3 rows, run_minmax_rows 3)."""
    from megatron_ext.kernels import triton_ops
    monkeypatch.setattr(triton_ops, "_MAX_GRID_ROWS", 1)
    contract_cases.run_row_strided_inputs(tri)
    contract_cases.run_minmax_rows(tri, cases=contract_cases.MINMAX_ROWS_CASES[:1])   # ByteGrad's: 3 rows


class _LaunchSpy:
    """Stands in for a kernel's launcher in ``triton_ops``: counts launches and forwards them."""

    def __init__(self, launcher):
        self.launcher, self.launches = launcher, 0

    def __call__(self, grid, *args, **kwargs):
        self.launches += 1
        return self.launcher(grid, *args, **kwargs)


def test_dispatch_selects_triton(tri, monkeypatch):
    """The public functions launch the Triton kernels when forced (CPU tensors run interpreted), and only then; on a GPU
    the Triton and torch paths agree on the same CUDA tensors."""
    from megatron_ext import kernels as K
    from megatron_ext.kernels import triton_ops
    spies = {}
    for name in ("swizzle_quantize", "reduce", "partial_minmax", "minmax_quantize", "minmax_dequantize_reduce"):
        spies[name] = _LaunchSpy(getattr(triton_ops, "_" + name))
        monkeypatch.setattr(triton_ops, "_" + name, spies[name])
    x = _data(300, torch.float32, 1).to(DEVICE)  # the public functions dispatch on the tensors' device
    codes, scales = ref.quantize_symmetric(x, bits=4, group_size=32)
    chunks, sc2 = codes[:64].view(2, 32), scales[:4].view(2, 2)
    q, mins, maxs = ref.quantize_minmax_uint8(x, 100)
    ops = [("swizzle_quantize", lambda: K.quantize_symmetric(x, bits=4, group_size=32)),
           ("swizzle_quantize", lambda: K.swizzle_quantize(x, 4, 32, 2, 2, 1)),
           ("reduce", lambda: K.dequantize_symmetric(codes, scales, bits=4, group_size=32, numel=300)),
           ("reduce", lambda: K.dequantize_reduce_quantize(chunks, sc2, 4, 32)),
           ("reduce", lambda: K.dequantize_reduce(chunks, sc2, bits=4, group_size=32)),
           ("minmax_quantize", lambda: K.quantize_minmax_uint8(x, 100)),
           ("minmax_dequantize_reduce", lambda: K.dequantize_minmax_uint8(q, mins, maxs, 100, 300)),
           ("minmax_dequantize_reduce", lambda: K.dequantize_minmax_reduce(
               torch.stack([q, q]), torch.stack([mins, mins]), torch.stack([maxs, maxs]), 100, 300))]
    for kernel, call in ops:
        with K.use_backend("torch"):
            want = call()
        assert all(s.launches == 0 for s in spies.values()), kernel  # the torch path never touches Triton
        with K.use_backend("triton"):
            got = call()
        assert spies[kernel].launches >= 1, kernel
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            _same(a, b)
        for s in spies.values():
            s.launches = 0
