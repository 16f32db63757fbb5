"""Cases every kernel backend must meet exactly: hand-written codes at rounding ties, and the bad-input contract.

Not collected (no ``test_`` prefix): ``test_reference.py`` runs them on the torch reference and ``triton_cases.py`` on
the Triton kernels (interpreted), so both backends are held to the same hand-written numbers and the same errors.
Each ``run_*`` takes a backend module (``reference`` or ``triton_ops``: same functions, same signatures).
Inputs that only feed the op under test (codes and scales to decode, reduce or reject) come from the eager
reference, never from ``impl``: on the Inductor path each new combination ``impl`` runs is one more cold compile,
so a case compiles only what it checks. Expected values taken from ``impl`` itself (an op without ``out`` against
the same op with it, a reduction against its own sum) stay on ``impl``.

Ties: every input below is chosen so that ``x / scale`` is *exactly* ``k + 1/2`` (scales 1, 2, 3 and 0.5 make the
divisions exact in fp32), positive and negative, at small codes and next to +-qmax. Round half to even sends
0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 125.5 -> 126, 126.5 -> 126, 6.5 -> 6; rounding half away from zero (C's ``round``)
would give 1, 2, 3, 126, 127, 7 and fails these cases.

Group sizes: on the Inductor path (test_compiled.py) every new (op, bits, group size, ``k``, dtype) combination is one
more cold compile, so where a case compiles there (two groups, or two min-max pieces of 16, or more) it uses what the
hypothesis tests of that file compile anyway: quantization in groups of 64, the INT8 reductions over k = 3 chunks in
groups of 6, the INT4 ones over k = 2 chunks in groups of 64, min-max pieces of 16 from bf16 input. A hand-written tie
group of 16 (INT8) or 8 (INT4) values lies inside a group of 64 padded with zeros, which change neither the group's
absmax nor any code (zeros quantize to 0). Cases of a single group (or under two pieces) run eagerly there, so they
keep their small sizes. Their own graphs, on purpose: run_reduce_factor_out's fp32 sum of INT8 groups of 6 (every
factor but 1 starts from it) and bf16 sums of INT4 groups of 64 (a 16-bit result at factor 1; cut and whole), and
run_row_strided_inputs' bf16 row decode of INT4 groups of 64 (16-bit out rows of several groups).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_ext.kernels import reference as ref

# INT8, groups of 16. Group 0: absmax 127 -> scale 1. Group 1: absmax 381 -> scale 3 (every x is 3 * (k + 1/2)).
INT8_TIE_X = [127.0, -127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 125.5, -125.5, 126.5, -126.5, 3.5, -3.5, 0.25, -100.0,
              -381.0, 1.5, -1.5, 4.5, -4.5, 7.5, -7.5, 376.5, -376.5, 379.5, -379.5, 10.5, -10.5, 0.0, 0.0, 3.0]
INT8_TIE_CODES = [127, -127, 0, 0, 2, -2, 2, -2, 126, -126, 126, -126, 4, -4, 0, -100,
                  -127, 0, 0, 2, -2, 2, -2, 126, -126, 126, -126, 4, -4, 0, 0, 1]
INT8_TIE_SCALES = [1.0, 3.0]

# INT4, groups of 8. Group 0: absmax 7 -> scale 1. Group 1: absmax 21 -> scale 3.
INT4_TIE_X = [7.0, 0.5, -0.5, 1.5, -2.5, 2.5, 6.5, -6.5,
              -21.0, 1.5, 4.5, -4.5, 7.5, -7.5, 19.5, -19.5]
# codes [7, 0, 0, 2, -2, 2, 6, -6] and [-7, 0, 2, -2, 2, -2, 6, -6]; even element in the high nibble, -2 = 0xE,
# -6 = 0xA, -7 = 0x9
INT4_TIE_BYTES = [0x70, 0x02, 0xE2, 0x6A, 0x90, 0x2E, 0x2E, 0x6A]
INT4_TIE_SCALES = [1.0, 3.0]


def _in_groups_of(values: list, per: int, width: int) -> list:
    """Each run of ``per`` values inside a group of ``width`` padded with zeros: the first run at the group's start,
    the next at its end, alternating (the tie values at both ends of the vector loops)."""
    out = []
    for i in range(0, len(values), per):
        lead = 0 if (i // per) % 2 == 0 else width - per
        out += [0] * lead + list(values[i:i + per]) + [0] * (width - per - lead)
    return out


def run_symmetric_ties(impl) -> None:
    """quantize_symmetric: INT8 and INT4 ties against the hand-written codes, each tie group inside a group of 64
    padded with zeros (same absmax, so the same scale; zeros give code 0)."""
    x = torch.tensor(_in_groups_of(INT8_TIE_X, 16, 64), dtype=torch.float32)
    codes, scales = impl.quantize_symmetric(x, bits=8, group_size=64)
    assert codes.tolist() == _in_groups_of(INT8_TIE_CODES, 16, 64) and scales.tolist() == INT8_TIE_SCALES
    x = torch.tensor(_in_groups_of(INT4_TIE_X, 8, 64), dtype=torch.float32)
    codes, scales = impl.quantize_symmetric(x, bits=4, group_size=64)
    assert codes.tolist() == _in_groups_of(INT4_TIE_BYTES, 4, 32) and scales.tolist() == INT4_TIE_SCALES


def run_swizzle_ties(impl) -> None:
    """swizzle_quantize, 2 nodes x 2 ranks x 2 stages: eight tie groups, one per stage chunk, land in slot order.

    Slice ``i`` (of 8, ``i = p * S + s``) is the base tie group times ``(-1)^i * 2^i``: its scale is ``2^i`` times the
    base scale (exact) and its codes are the base codes times ``(-1)^i`` (half to even is symmetric). Output slot
    ``k`` holds slice ``[0, 4, 2, 6, 1, 5, 3, 7][k]`` (stage 0: partitions 0, 2, 1, 3; then stage 1).
    """
    slot_slice = [0, 4, 2, 6, 1, 5, 3, 7]
    for bits, base_x, group in ((8, INT8_TIE_X[:16], 16), (4, INT4_TIE_X[:8], 8)):
        base = torch.tensor(base_x)
        x = torch.cat([base * ((-1) ** i * 2.0 ** i) for i in range(8)])
        codes, scales = impl.swizzle_quantize(x, bits, group, 2, 2, 2)
        assert tuple(codes.shape[:2]) == (2, 4) and tuple(scales.shape) == (2, 4, 1)
        for k, i in enumerate(slot_slice):
            sign = (-1) ** i
            if bits == 8:
                want = [sign * c for c in INT8_TIE_CODES[:16]]
                got = codes.view(8, -1)[k].tolist()
            else:
                want = [sign * c for c in (7, 0, 0, 2, -2, 2, 6, -6)]
                b = codes.view(8, -1)[k].view(torch.int8)
                got = torch.stack([b >> 4, (b.view(torch.uint8) << 4).view(torch.int8) >> 4], -1).view(-1).tolist()
            assert got == want, (bits, k, got, want)
            assert scales.view(8)[k].item() == 2.0 ** i, (bits, k)  # base scale 1


def run_requantize_ties(impl) -> None:
    """dequantize_reduce_quantize over k = 2 chunks with scales 1 and 1/2: the fp32 sums c0 + c1/2 are exact ties."""
    # INT8: sum = [127, -127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 125.5, -125.5, 126.5, -126.5, 3.5, -3.5, 0, -100]
    c0 = [127, -127, 0, 0, 1, -1, 2, -2, 125, -125, 126, -126, 3, -3, 0, -100]
    c1 = [0, 0, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 0, 0]
    chunks = torch.tensor([c0, c1], dtype=torch.int8)
    scales = torch.tensor([[1.0], [0.5]])
    codes, out_scales = impl.dequantize_reduce_quantize(chunks, scales, 8, 16)
    assert codes.tolist() == [127, -127, 0, 0, 2, -2, 2, -2, 126, -126, 126, -126, 4, -4, 0, -100]
    assert out_scales.tolist() == [1.0]
    total = impl.dequantize_reduce(chunks, scales, bits=8, group_size=16)
    assert total.tolist() == [a + b / 2 for a, b in zip(c0, c1)]
    # INT4: c0 = [7, 0, 0, 1, -2, 2, 6, -6], c1 = [0, 1, -1, 1, -1, 1, 1, -1]
    # sum = [7, 0.5, -0.5, 1.5, -2.5, 2.5, 6.5, -6.5] -> codes [7, 0, 0, 2, -2, 2, 6, -6]
    chunks = torch.tensor([[0x70, 0x01, 0xE2, 0x6A], [0x01, 0xF1, 0xF1, 0x1F]], dtype=torch.uint8)
    codes, out_scales = impl.dequantize_reduce_quantize(chunks, scales, 4, 8)
    assert codes.tolist() == [0x70, 0x02, 0xE2, 0x6A] and out_scales.tolist() == [1.0]


def run_non_contiguous_rejected(impl) -> None:
    """Strided codes / scales / chunks / q: the same clear ValueError on every backend (never a raw view error or
    silently reordered data), and a dtype error that names the expected dtype."""
    x = torch.randn(64)
    codes, scales = ref.quantize_symmetric(x, bits=8, group_size=8)  # 8 scales
    scales_2d = scales.view(4, 2).t()  # 2-D, non-contiguous, all 8 scales present
    with pytest.raises(ValueError, match=r"scales must be contiguous .*strides"):
        impl.dequantize_symmetric(codes, scales_2d, bits=8, group_size=8, numel=64)
    with pytest.raises(ValueError, match=r"codes must be contiguous"):
        impl.dequantize_symmetric(torch.stack([codes, codes], 1).view(-1)[::2], scales, bits=8, group_size=8,
                                  numel=64)
    chunks = torch.stack([codes, codes])  # [2, 64]
    sc2 = torch.stack([scales, scales])  # [2, 8]
    bad_sc2 = torch.stack([scales, scales], 1).t()  # same values, non-contiguous
    bad_chunks = torch.stack([codes, codes], 1).t()
    # the reduce ops take rows at any stride (run_row_strided_inputs), never a row that is itself strided
    for fn in (lambda c, s: impl.dequantize_reduce_quantize(c, s, 8, 8),
               lambda c, s: impl.dequantize_reduce(c, s, bits=8, group_size=8)):
        with pytest.raises(ValueError, match=r"scales must be 2-D with contiguous rows .*strides"):
            fn(chunks, bad_sc2)
        with pytest.raises(ValueError, match=r"chunks must be 2-D with contiguous rows .*strides"):
            fn(bad_chunks, sc2)
    out = torch.empty(2, 64)
    with pytest.raises(ValueError, match=r"codes must be 2-D with contiguous rows .*strides"):
        impl.dequantize_rows(bad_chunks, sc2, bits=8, group_size=8, out=out)
    with pytest.raises(ValueError, match=r"out must be 2-D with contiguous rows .*strides"):
        impl.dequantize_rows(chunks, sc2, bits=8, group_size=8, out=torch.empty(64, 2).t())
    q, mins, maxs = ref.quantize_minmax_uint8(x, 16)
    with pytest.raises(ValueError, match=r"q must be contiguous .*strides"):
        impl.dequantize_minmax_uint8(torch.stack([q, q], 1).view(-1)[::2], mins, maxs, 16, 64)
    with pytest.raises(TypeError, match=r"must be torch.uint8, got torch.int8"):
        impl.dequantize_minmax_uint8(q.view(torch.int8), mins, maxs, 16, 64)


def _wire_rows(codes: torch.Tensor, scales: torch.Tensor, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes [k, b]`` and ``scales [k, g]`` copied into the rows of a byte buffer as a backend sends them
    (``[codes | pad | scales]``, ``lead`` junk bytes first, junk in the pad), returned as the strided views a
    receiver reads."""
    k, cb = codes.shape
    cb_pad = -(-cb // 4) * 4
    row = lead + cb_pad + 4 * scales.shape[1]
    buf = torch.full((k, row), 0xA5, dtype=torch.uint8)
    buf[:, lead:lead + cb] = codes.view(torch.uint8)
    buf[:, lead + cb_pad:] = scales.contiguous().view(torch.uint8)
    return buf[:, lead:lead + cb].view(codes.dtype), buf[:, lead + cb_pad:].view(torch.float32)


def _minmax_wire_rows(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    """ByteGrad's ``(q, mins, maxs)`` per row laid out as its ``[q | pad | mins | maxs]`` wire rows (junk around):
    the strided ``q`` and ``[mins | maxs]`` views a receiver reads."""
    return _wire_rows(torch.stack([q for q, _, _ in rows]), torch.stack([torch.cat([mn, mx]) for _, mn, mx in rows]),
                      lead=4)


def run_row_strided_inputs(impl) -> None:
    """Rows of a received byte buffer (codes and scales interleaved per row, padding between them) are read in place
    and give the bits of contiguous inputs: the two qgZ reductions over k chunks, and ``dequantize_rows`` (qwZ's
    decode of all gathered rows, straight into the destination) against a per-row ``dequantize_symmetric``."""
    g = torch.Generator().manual_seed(3)
    # k rows of 5, 5, 6, 1 and 2 groups; the second, third and last decode to more than n (the padding is dropped);
    # INT8 into 16-bit rows at the group of 64 the compiled path's hypothesis cases already decode to bf16
    for bits, group, k, n, dtypes in ((8, 6, 3, 30, (torch.float32,)), (8, 6, 3, 27, (torch.float32,)),
                                      (4, 64, 2, 362, (torch.float32, torch.bfloat16)),
                                      (4, 64, 2, 64, (torch.float32, torch.bfloat16)),
                                      (8, 64, 3, 101, (torch.bfloat16,))):
        pieces = [ref.quantize_symmetric(torch.randn(n, generator=g) * 3, bits=bits, group_size=group)
                  for _ in range(k)]
        codes = torch.stack([c for c, _ in pieces])
        scales = torch.stack([s for _, s in pieces])
        for lead in (0, 4):
            c, s = _wire_rows(codes, scales, lead)
            assert not c.is_contiguous() and not s.is_contiguous()
            for a, b in zip(impl.dequantize_reduce_quantize(c, s, bits, group),
                            impl.dequantize_reduce_quantize(codes, scales, bits, group)):
                _same(a, b)
            _same(impl.dequantize_reduce(c, s, bits=bits, group_size=group, numel=n - 1),
                  impl.dequantize_reduce(codes, scales, bits=bits, group_size=group, numel=n - 1))
            for dtype in dtypes:
                whole = torch.full((k, n + 5), 7.0, dtype=dtype)
                out = whole[:, 2:2 + n]   # strided rows; the columns around them must stay untouched
                assert impl.dequantize_rows(c, s, bits=bits, group_size=group, out=out) is out
                for r, (cr, sr) in enumerate(pieces):
                    _same(out[r], impl.dequantize_symmetric(cr, sr, bits=bits, group_size=group, numel=n,
                                                            dtype=dtype))
                assert whole[:, :2].eq(7).all() and whole[:, 2 + n:].eq(7).all()
    codes, scales = ref.quantize_symmetric(torch.randn(64), bits=8, group_size=8)
    with pytest.raises(ValueError, match=r"same rows"):
        impl.dequantize_rows(codes.view(2, 32), scales.view(1, 8), bits=8, group_size=8, out=torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"scales and out must be on codes' device cpu, got cpu and meta"):
        impl.dequantize_rows(codes.view(2, 32), scales.view(2, 4), bits=8, group_size=8,
                             out=torch.empty(2, 32, device="meta"))
    with pytest.raises(ValueError, match=r"decodes to at most 32 elements; got 32 bytes and out rows of 33"):
        impl.dequantize_rows(codes.view(2, 32), scales.view(2, 4), bits=8, group_size=8, out=torch.empty(2, 33))
    with pytest.raises(ValueError, match=r"out's rows overlap \(row stride 0 < row length 32\)"):
        impl.dequantize_rows(codes.view(2, 32), scales.view(2, 4), bits=8, group_size=8,
                             out=torch.empty(1, 32).expand(2, 32))


def _out_rows(rows: int, code_bytes: int, groups: int, dtype: torch.dtype):
    """A junk-filled byte buffer and ``(codes [rows, code_bytes/rows], scales [rows, groups/rows])`` views of it,
    laid out as wire rows with 4 junk bytes before and after each row's data."""
    cb, g = code_bytes // rows, groups // rows
    cb_pad = -(-cb // 4) * 4
    buf = torch.full((rows, 4 + cb_pad + 4 * g + 4), 0xA5, dtype=torch.uint8)
    return buf, (buf[:, 4:4 + cb].view(dtype), buf[:, 4 + cb_pad:4 + cb_pad + 4 * g].view(torch.float32))


def _check_out_rows(buf, out, got, want) -> None:
    """``got`` (the op's return with ``out``) is ``out``, holding ``want``'s bytes row by row; junk intact."""
    assert got[0] is out[0] and got[1] is out[1]
    rows = out[0].shape[0]
    _same(out[0], want[0].reshape(rows, -1))
    _same(out[1], want[1].reshape(rows, -1))
    junk = buf.clone()
    junk[:, 4:4 + out[0].shape[1]] = 0xA5
    cb_pad = -(-out[0].shape[1] // 4) * 4
    junk[:, 4 + cb_pad:4 + cb_pad + 4 * out[1].shape[1]] = 0xA5
    assert junk.eq(0xA5).all()


def run_out_rows(impl) -> None:
    """The quantizing ops write into ``out`` rows (wire rows: strided, padding and junk around) the bytes they return
    without ``out``: plain quantization, qgZ's swizzle in its first hop's rows, and its requantization in the second
    hop's rows; bad ``out`` arguments are clear errors."""
    g = torch.Generator().manual_seed(5)
    for bits, n, rows in ((8, 320, (1, 5)), (4, 362, (1, 2, 3)), (4, 128, (1, 2))):   # groups of 64: 5, 6, 2
        x = torch.randn(n, generator=g) * 2
        want = impl.quantize_symmetric(x, bits=bits, group_size=64)
        for r in rows:
            buf, out = _out_rows(r, want[0].numel(), want[1].numel(), want[0].dtype)
            _check_out_rows(buf, out, impl.quantize_symmetric(x, bits=bits, group_size=64, out=out), want)
    for bits in (8, 4):
        x = torch.randn(50, generator=g)
        want = impl.swizzle_quantize(x, bits, 8, 2, 2, 2)   # [S=2, W=4, chunk]
        for r in (4, 8):   # qgZ's rows: N slots for each local peer (S*D rows), or one slot a row
            buf, out = _out_rows(r, want[0].numel(), want[1].numel(), want[0].dtype)
            _check_out_rows(buf, out, impl.swizzle_quantize(x, bits, 8, 2, 2, 2, out=out), want)
        group, k = (6, 3) if bits == 8 else (64, 2)   # 6 groups a chunk
        pieces = [ref.quantize_symmetric(torch.randn(6 * group, generator=g), bits=bits, group_size=group)
                  for _ in range(k)]
        chunks, scales = torch.stack([c for c, _ in pieces]), torch.stack([s for _, s in pieces])
        want = impl.dequantize_reduce_quantize(chunks, scales, bits, group)
        for r in (1, 2, 6):
            buf, out = _out_rows(r, want[0].numel(), want[1].numel(), want[0].dtype)
            _check_out_rows(buf, out, impl.dequantize_reduce_quantize(chunks, scales, bits, group, out=out), want)
    x = torch.randn(40)
    codes, scales = torch.empty(2, 20, dtype=torch.int8), torch.empty(2, 3)
    with pytest.raises(ValueError, match=r"split 40 code bytes and 5 scales into equal rows"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=(codes, scales))
    with pytest.raises(TypeError, match=r"out codes for 8-bit codes must be torch.int8"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=(codes.view(torch.uint8), scales))
    with pytest.raises(TypeError, match=r"out scales must be float32"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=(torch.empty(1, 40, dtype=torch.int8),
                                                              torch.empty(1, 5, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"out scales' rows overlap \(row stride 0 < row length 1\)"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=(torch.empty(5, 8, dtype=torch.int8),
                                                              torch.empty(1, 1).expand(5, 1)))
    with pytest.raises(ValueError, match=r"out codes must be 2-D with contiguous rows"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=(torch.empty(8, 5, dtype=torch.int8).t(),
                                                              torch.empty(5, 1)))
    with pytest.raises(TypeError, match=r"out must be a \(codes, scales\) pair"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=torch.empty(40, dtype=torch.int8))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (a, b)


def run_bad_arguments_rejected(impl) -> None:
    """No chunks, a non-positive min-max chunk size, maxima shorter than the chunks: a clear ValueError on every
    backend, before any kernel reads memory (the native C would otherwise read past the arrays)."""
    codes, scales = ref.quantize_symmetric(torch.randn(64), bits=8, group_size=8)
    for fn in (lambda c, s: impl.dequantize_reduce_quantize(c, s, 8, 8),
               lambda c, s: impl.dequantize_reduce(c, s, bits=8, group_size=8)):
        with pytest.raises(ValueError, match=r"at least one chunk"):
            fn(codes.view(1, -1)[:0], scales.view(1, -1)[:0])
    q, mins, maxs = ref.quantize_minmax_uint8(torch.randn(64), 16)  # 4 chunks
    for chunk in (0, -5):
        with pytest.raises(ValueError, match=r"chunk_size must be positive"):
            impl.dequantize_minmax_uint8(q, mins, maxs, chunk, 64)
    with pytest.raises(ValueError, match=r"4 chunks of 16: got 64 codes, 4 mins and 1 maxs"):
        impl.dequantize_minmax_uint8(q, mins, maxs[:1].contiguous(), 16, 64)


def run_minmax_overflow(impl) -> None:
    """A constant chunk with |x| > FLT_MAX / 2.55e9 (~1.33e29) overflows max*scale: codes 0, dequantized +-inf with
    the sign of x (ByteGrad's formula, documented in quantize_minmax_uint8); |x| = 1e29 still round-trips."""
    x = torch.tensor([2e29] * 4 + [-2e29] * 4 + [1e29] * 4 + [-1e29] * 4)
    q, mins, maxs = impl.quantize_minmax_uint8(x, 4)
    assert q[:8].tolist() == [0] * 8
    y = impl.dequantize_minmax_uint8(q, mins, maxs, 4, 16)
    assert y[:8].tolist() == [float("inf")] * 4 + [float("-inf")] * 4
    assert torch.allclose(y[8:], x[8:], rtol=1e-6)


def run_minmax_reduce(impl) -> None:
    """ByteGrad's decode-and-average reads the ``[q | pad | mins | maxs]`` rows of a received buffer in place and
    gives the bits of its definition: each row decoded alone, summed in row order, times fl32(factor), cast. Rows
    longer than ``numel``, a partial last chunk, an overflowing (inf) chunk, one row; bad arguments are clear errors."""
    g = torch.Generator().manual_seed(11)
    # chunks of several Triton blocks (3000 > 2048), chunks longer than the rows (100 > 40)
    for k, length, numel, chunk in ((3, 83, 80, 7), (2, 24, 24, 16), (1, 9, 5, 4), (2, 12, 0, 4), (2, 4500, 4400, 3000),
                                    (2, 40, 30, 100)):
        nc = -(-length // chunk)
        rows = []
        for a in range(k):
            x = torch.randn(length, generator=g) * (a + 1) + a
            if a in (1, 2):   # constant chunks whose max * scale overflows: they decode to +inf and -inf, the sum NaN
                x[:chunk] = 2e29 if a == 1 else -2e29
            rows.append(ref.quantize_minmax_uint8(x, chunk))
        q, mm = _minmax_wire_rows(rows)
        assert not q.is_contiguous() or k == 1
        for factor, dtype in ((1.0, torch.float32), (1 / 3, torch.float32), (0.125, torch.bfloat16)):
            want = impl.dequantize_minmax_uint8(*rows[0], chunk, numel)
            for a in range(1, k):
                want = want + impl.dequantize_minmax_uint8(*rows[a], chunk, numel)
            want = (want * factor).to(dtype)
            got = impl.dequantize_minmax_reduce(q, mm[:, :nc], mm[:, nc:], chunk, numel, factor=factor, dtype=dtype)
            into = torch.full((numel + 3,), 7.0, dtype=dtype)   # out: a slice with neighbours that stay untouched
            out = into[1:numel + 1]
            assert impl.dequantize_minmax_reduce(q, mm[:, :nc], mm[:, nc:], chunk, numel, factor=factor, dtype=dtype,
                                                 out=out) is out
            _same(out, got)
            assert into[0].item() == into[numel + 1].item() == into[numel + 2].item() == 7.0
            nan = want.isnan()
            assert nan.any() == (k == 3 and numel > 0)
            if dtype == torch.bfloat16:   # every backend's bf16 NaN is torch's CPU one, 0xFFFF
                _same(got, want)
            else:   # fp32: a NaN stays NaN; its bits are the device arithmetic's
                assert torch.equal(got.isnan(), nan)
                _same(got.masked_fill(nan, 0), want.masked_fill(nan, 0))
    q, mins, maxs = ref.quantize_minmax_uint8(torch.randn(64), 16)   # 4 chunks
    q2, mins2, maxs2 = torch.stack([q, q]), torch.stack([mins, mins]), torch.stack([maxs, maxs])
    with pytest.raises(ValueError, match=r"same k >= 1 rows"):
        impl.dequantize_minmax_reduce(q2, mins2[:1], maxs2, 16, 64)
    with pytest.raises(ValueError, match=r"65 elements need 5 chunks of 16 per row: got rows of 64 codes"):
        impl.dequantize_minmax_reduce(q2, mins2, maxs2, 16, 65)
    with pytest.raises(ValueError, match=r"64 elements need 4 chunks of 16 per row: got rows of 64 codes, 4 mins "
                                         r"and 3 maxs"):
        impl.dequantize_minmax_reduce(q2, mins2, maxs2[:, :3], 16, 64)
    with pytest.raises(ValueError, match=r"chunk_size must be positive"):
        impl.dequantize_minmax_reduce(q2, mins2, maxs2, 0, 64)
    with pytest.raises(TypeError, match=r"mins must be float32"):
        impl.dequantize_minmax_reduce(q2, mins2.double(), maxs2, 16, 64)
    with pytest.raises(ValueError, match=r"q must be 2-D with contiguous rows"):
        impl.dequantize_minmax_reduce(q2.t().contiguous().t(), mins2, maxs2, 16, 64)
    for bad, what in ((torch.empty(63), r"\(63,\)"), (torch.empty(64, dtype=torch.bfloat16), "torch.bfloat16"),
                      (torch.empty(2, 32).t(), "not contiguous")):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of 64 elements.*" + what):
            impl.dequantize_minmax_reduce(q2, mins2, maxs2, 16, 64, out=bad)


# rows, length, chunk (chunk 16: a whole and a partial chunk, 24 elements, under the two pieces of 16 that the
# compiled path would compile a graph for: run_minmax_reduce's chunk-16 case alike)
MINMAX_ROWS_CASES = ((3, 83, 7), (2, 24, 16), (1, 5, 4), (2, 4500, 3000), (2, 30, 100))


def run_minmax_rows(impl, cases=MINMAX_ROWS_CASES) -> None:
    """ByteGrad's all-gathered rows decoded by one call where they lie (``[q | pad | mins | maxs]`` rows, junk
    around) into strided ``out`` rows: row ``r`` gets the bits of the plain decode of row ``r`` (a partial last
    chunk, chunks of several Triton blocks, an overflowing chunk that decodes to inf), and nothing beside the rows
    is written; bad ``out`` arguments are clear errors."""
    g = torch.Generator().manual_seed(17)
    for k, n, chunk in cases:
        nc = -(-n // chunk)
        rows = []
        for a in range(k):
            x = torch.randn(n, generator=g) * (a + 1) - a
            if a == 1:
                x[:chunk] = -2e29   # a constant chunk whose max * scale overflows: it decodes to -inf
            rows.append(ref.quantize_minmax_uint8(x, chunk))
        q, mm = _minmax_wire_rows(rows)
        # the mins also from a buffer of their own, at another row stride than the maxs (NaN beyond them)
        own = torch.full((k, nc + 5), float("nan"))
        own[:, :nc] = mm[:, :nc]
        for dtype, mins in ((torch.float32, mm[:, :nc]), (torch.bfloat16, mm[:, :nc]), (torch.float32, own[:, :nc])):
            into = torch.full((k, n + 3), 7.0, dtype=dtype)
            out = into[:, 1:n + 1]
            assert impl.dequantize_minmax_rows(q, mins, mm[:, nc:], chunk, out=out) is out
            for a in range(k):
                _same(out[a], impl.dequantize_minmax_uint8(*rows[a], chunk, n, dtype))
            assert into[:, 0].eq(7).all() and into[:, n + 1:].eq(7).all()
            if k > 1:
                assert out[1, :chunk].eq(float("-inf")).all()
    q, mins, maxs = ref.quantize_minmax_uint8(torch.randn(64), 16)   # 4 chunks
    q2, mins2, maxs2 = torch.stack([q, q]), torch.stack([mins, mins]), torch.stack([maxs, maxs])
    with pytest.raises(ValueError, match=r"q, mins, maxs and out must have the same rows; got \(2, 64\), \(2, 4\), "
                                         r"\(2, 4\) and \(3, 64\)"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 16, out=torch.empty(3, 64))
    with pytest.raises(ValueError, match=r"q must be 2-D with contiguous rows"):
        impl.dequantize_minmax_rows(q, mins2, maxs2, 16, out=torch.empty(2, 64))
    with pytest.raises(ValueError, match=r"out must be on q's device cpu, got meta"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 16, out=torch.empty(2, 64, device="meta"))
    with pytest.raises(ValueError, match=r"chunk_size must be positive"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 0, out=torch.empty(2, 64))
    none = torch.empty(0, 64)   # no rows: nothing to decode
    assert impl.dequantize_minmax_rows(q2[:0], mins2[:0], maxs2[:0], 16, out=none) is none
    with pytest.raises(ValueError, match=r"out must be 2-D with contiguous rows"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 16, out=torch.empty(64, 2).t())
    with pytest.raises(ValueError, match=r"out's rows overlap"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 16, out=torch.empty(96).as_strided((2, 64), (32, 1)))
    with pytest.raises(TypeError, match=r"out must be float32, float16 or bfloat16, got torch.int32"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 16, out=torch.empty(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"65 elements need 5 chunks of 16 per row: got rows of 64 codes"):
        impl.dequantize_minmax_rows(q2, mins2, maxs2, 16, out=torch.empty(2, 65))
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        wire = torch.empty(2, 64 + 32)
        impl.dequantize_minmax_rows(q2, wire[:, 64:80], wire[:, 80:], 16, out=wire[:, :64])


def run_reduce_factor_out(impl) -> None:
    """qgZ's last step, ``dequantize_reduce`` with ``factor`` and ``out``: the rows of a received buffer, read in
    place, give the bits of its definition (the fp32 sum, times fl32(factor), cast), written into a slice of a larger
    tensor (starting at an odd element: INT4's pair writes must not need an even one) whose neighbours stay
    untouched; a cut last group; bad ``out`` and ``dtype`` are clear errors."""
    g = torch.Generator().manual_seed(5)
    for bits, group, k, n, numel in ((8, 6, 3, 30, 29), (4, 64, 2, 362, 361), (4, 64, 2, 128, 128), (8, 6, 3, 12, 0)):
        pieces = [ref.quantize_symmetric(torch.randn(n, generator=g) * 3, bits=bits, group_size=group)
                  for _ in range(k)]
        c, s = _wire_rows(torch.stack([q for q, _ in pieces]), torch.stack([sc for _, sc in pieces]), lead=4)
        total = impl.dequantize_reduce(c, s, bits=bits, group_size=group, numel=numel)
        for factor, dtype in ((1.0, torch.float32), (1 / 3, torch.float32), (1 / 6, torch.bfloat16),
                              (0.125, torch.float16), (1.0, torch.bfloat16)):
            want = (total * factor).to(dtype)
            got = impl.dequantize_reduce(c, s, bits=bits, group_size=group, numel=numel, factor=factor, dtype=dtype)
            _same(got, want)
            into = torch.full((numel + 3,), 7.0, dtype=dtype)
            out = into[1:numel + 1]
            assert impl.dequantize_reduce(c, s, bits=bits, group_size=group, numel=numel, factor=factor, dtype=dtype,
                                          out=out) is out
            _same(out, want)
            assert into[0].item() == into[numel + 1].item() == into[numel + 2].item() == 7.0
            square = torch.empty(1, numel, dtype=dtype)   # a 2-D out: written as its flat elements, no resize
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                impl.dequantize_reduce(c, s, bits=bits, group_size=group, numel=numel, factor=factor, dtype=dtype,
                                       out=square)
            assert square.shape == (1, numel)
            _same(square.view(-1), want)
    codes, scales = ref.quantize_symmetric(torch.randn(64), bits=8, group_size=8)
    chunks, sc = codes.view(2, 32), scales.view(2, 4)
    for bad, what in ((torch.empty(31), r"\(31,\)"), (torch.empty(32, dtype=torch.bfloat16), "torch.bfloat16"),
                      (torch.empty(2, 16).t(), "not contiguous")):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of 32 elements.*" + what):
            impl.dequantize_reduce(chunks, sc, bits=8, group_size=8, factor=0.5, out=bad)
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.dequantize_reduce(chunks, sc, bits=8, group_size=8, numel=8, out=sc.view(-1)[:8])
    with pytest.raises(TypeError, match=r"dtype must be float32, float16 or bfloat16, got torch.int32"):
        impl.dequantize_reduce(chunks, sc, bits=8, group_size=8, dtype=torch.int32)


def run_out_aliasing_rejected(impl) -> None:
    """An ``out`` laid over the op's own input is refused before any write (the kernels would overwrite what other
    programs still read): plain quantization, qgZ's swizzle and requantization, qwZ's row decode, ByteGrad's decode."""
    x = torch.randn(64)
    over_x = (x.view(torch.int8)[:64].view(1, 64), x[40:48].view(1, 8))   # codes and scales in x's own bytes
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.quantize_symmetric(x, bits=8, group_size=8, out=over_x)
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.swizzle_quantize(x, 8, 8, 2, 2, 1, out=over_x)
    codes, scales = ref.quantize_symmetric(x, bits=8, group_size=8)
    chunks, sc = codes.view(2, 32), scales.view(2, 4)
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):   # the result over the second chunk
        impl.dequantize_reduce_quantize(chunks, sc, 8, 8, out=(chunks[1:], torch.empty(1, 4)))
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.dequantize_reduce_quantize(chunks, sc, 8, 8, out=(torch.empty(1, 32, dtype=torch.int8), sc[:1]))
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.dequantize_rows(chunks, sc, bits=8, group_size=8, out=sc.view(-1)[:4].view(2, 2))
    q, mins, maxs = ref.quantize_minmax_uint8(x, 16)   # ByteGrad's decode into its own (min, max) row
    mm = torch.cat([mins, maxs]).view(1, -1)
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.dequantize_minmax_reduce(q.view(1, -1), mm[:, :4], mm[:, 4:], 16, 8, out=mm.view(-1)[:8])
    # the same op into separate memory runs (3 chunks of 6 groups of 6: the compiled path's INT8 reduce combination)
    codes, scales = ref.quantize_symmetric(torch.randn(108), bits=8, group_size=6)
    chunks, sc = codes.view(3, 36), scales.view(3, 6)
    want = ref.dequantize_reduce_quantize(chunks, sc, 8, 6)
    got = impl.dequantize_reduce_quantize(chunks, sc, 8, 6, out=(torch.empty(1, 36, dtype=torch.int8),
                                                                 torch.empty(1, 6)))
    _same(got[0].view(-1), want[0])
    _same(got[1].view(-1), want[1])


def run_minmax_out_rows(impl) -> None:
    """ByteGrad's quantizer writes into ``out`` rows (``[q | pad | mins | maxs]`` wire rows: strided, junk around)
    the values it returns without ``out``: rows of whole chunks, or one row ending in a partial chunk; bad ``out``
    arguments are clear errors."""
    g = torch.Generator().manual_seed(13)
    # chunk 16 from bf16 (the compiled path's pieces of 16 come from bf16 inputs in test_compiled.py's hypothesis)
    for numel, chunk, rows, dtype in ((96, 16, (1, 2, 3, 6), torch.bfloat16), (90, 40, (1,), torch.float32),
                                      (64, 64, (1,), torch.float32), (8200, 4100, (1, 2), torch.float32)):
        x = (torch.randn(numel, generator=g) * 3 + 1).to(dtype)
        want = impl.quantize_minmax_uint8(x, chunk)
        for r in rows:
            n = numel // r
            per = -(-n // chunk)
            off = 4 + -(-n // 4) * 4
            buf = torch.full((r, off + 8 * per + 4), 0xA5, dtype=torch.uint8)
            out = (buf[:, 4:4 + n], buf[:, off:off + 4 * per].view(torch.float32),
                   buf[:, off + 4 * per:off + 8 * per].view(torch.float32))
            got = impl.quantize_minmax_uint8(x, chunk, out=out)
            assert all(a is b for a, b in zip(got, out))
            for a, b in zip(out, want):
                _same(a, b.reshape(a.shape))
            junk = buf.clone()
            junk[:, 4:4 + n] = 0xA5
            junk[:, off:off + 8 * per] = 0xA5
            assert junk.eq(0xA5).all()
    x = torch.randn(96)
    with pytest.raises(ValueError, match=r"out must split 96 codes into equal rows of whole 40-element chunks"):
        impl.quantize_minmax_uint8(x, 40, out=(torch.empty(2, 48, dtype=torch.uint8), torch.empty(2, 2),
                                               torch.empty(2, 2)))
    with pytest.raises(ValueError, match=r"got q \(2, 48\), mins \(2, 2\) and maxs \(2, 3\)"):
        impl.quantize_minmax_uint8(x, 16, out=(torch.empty(2, 48, dtype=torch.uint8), torch.empty(2, 2),
                                               torch.empty(2, 3)))
    with pytest.raises(TypeError, match=r"out mins must be float32"):
        impl.quantize_minmax_uint8(x, 16, out=(torch.empty(2, 48, dtype=torch.uint8), torch.empty(2, 3).double(),
                                               torch.empty(2, 3)))
    with pytest.raises(TypeError, match=r"out must be a \(q, mins, maxs\) triple"):
        impl.quantize_minmax_uint8(x, 16, out=(torch.empty(96, dtype=torch.uint8), torch.empty(6)))
    with pytest.raises(ValueError, match=r"out overlaps the op's input"):
        impl.quantize_minmax_uint8(x, 16, out=(x.view(torch.uint8)[:96].view(1, 96), torch.empty(1, 6),
                                               torch.empty(1, 6)))
