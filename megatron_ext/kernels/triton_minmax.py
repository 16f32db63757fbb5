"""Triton kernels for ByteGrad's min-max UINT8 quantization.

A chunk is usually far larger than one program's tile (Bagua's default bucket is 10 MiB), so the per-chunk min/max
is a split reduction: every program reduces one ``BLOCK`` of one chunk, one program per chunk finishes it and derives
the chunk's (scale, lb), and the quantize kernel is then elementwise over ``[chunks, blocks]`` grids; dequantize
derives (scale, lb) from (min, max) itself. Three launches and one, so small tensors are not bound by launch count.
(scale, lb) follow :func:`.reference.minmax_params` operation for operation: torch evaluates ``255.0 / d`` as
``reciprocal(d) * 255``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_symmetric import rint, to_out_dtype


@triton.jit
def partial_minmax_kernel(x_ptr, pmin_ptr, pmax_ptr, numel, chunk_size, nblk, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # 1-D grid of chunks x blocks (a 2-D grid's second axis is capped at 65535 on CUDA)
    c = pid // nblk
    blk = pid % nblk
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = (offs < chunk_size) & (c * chunk_size + offs < numel)
    v = tl.load(x_ptr + c * chunk_size + offs, mask=ok, other=0.0).to(tl.float32)
    lo = tl.min(tl.where(ok, v, float("inf")), axis=0)
    hi = tl.max(tl.where(ok, v, float("-inf")), axis=0)
    tl.store(pmin_ptr + c * nblk + blk, lo)
    tl.store(pmax_ptr + c * nblk + blk, hi)


@triton.jit
def _params(mn, mx):
    """(scale, lb) of a chunk from its (min, max), as ``reference.minmax_params`` computes them."""
    d = (mx - mn) + 1e-7
    scale = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d) * 255.0
    return scale, rint(mx * scale) - 255.0


@triton.jit
def finish_minmax_kernel(pmin_ptr, pmax_ptr, mins_ptr, maxs_ptr, scale_ptr, lb_ptr, nblk, cpr, mins_stride,
                         maxs_stride, BLOCK: tl.constexpr):
    """One program per chunk: reduce its ``nblk`` partial minima / maxima, store (min, max, scale, lb); chunk ``c``'s
    min and max go to row ``c // cpr`` of the output rows (``cpr`` chunks a row), at column ``c % cpr``."""
    c = tl.program_id(0)
    lo = tl.full((BLOCK,), float("inf"), tl.float32)
    hi = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, nblk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < nblk
        lo = tl.minimum(lo, tl.load(pmin_ptr + c * nblk + offs, mask=ok, other=float("inf")))
        hi = tl.maximum(hi, tl.load(pmax_ptr + c * nblk + offs, mask=ok, other=float("-inf")))
    mn = tl.min(lo, axis=0)
    mx = tl.max(hi, axis=0)
    scale, lb = _params(mn, mx)
    tl.store(mins_ptr + (c // cpr) * mins_stride + c % cpr, mn)
    tl.store(maxs_ptr + (c // cpr) * maxs_stride + c % cpr, mx)
    tl.store(scale_ptr + c, scale)
    tl.store(lb_ptr + c, lb)


@triton.jit
def minmax_quantize_kernel(x_ptr, q_ptr, scale_ptr, lb_ptr, numel, chunk_size, nblk, cpr, q_stride,
                           BLOCK: tl.constexpr):
    """Chunk ``c``'s codes go to row ``c // cpr`` of the output rows (``cpr`` chunks a row, rows ``q_stride`` apart)."""
    pid = tl.program_id(0)  # 1-D grid of chunks x blocks (a 2-D grid's second axis is capped at 65535 on CUDA)
    c = pid // nblk
    blk = pid % nblk
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = (offs < chunk_size) & (c * chunk_size + offs < numel)
    scale = tl.load(scale_ptr + c)
    lb = tl.load(lb_ptr + c)
    ub = lb + 255.0
    v = tl.load(x_ptr + c * chunk_size + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.minimum(rint(v * scale), ub) - lb
    y = tl.where(y == y, y, 0.0)  # nan (inf - inf, an overflowing chunk) -> code 0, as the reference
    y = tl.minimum(tl.maximum(y, 0.0), 255.0)
    tl.store(q_ptr + (c // cpr) * q_stride + (c % cpr) * chunk_size + offs, y.to(tl.uint8), mask=ok)


@triton.jit
def minmax_dequantize_reduce_kernel(q_ptr, q_stride, mins_ptr, mins_stride, maxs_ptr, maxs_stride, out_ptr,
                                    out_stride, numel, chunk_size, nblk, k, factor, BLOCK: tl.constexpr):
    """ByteGrad's decode-and-average: the ``k`` rows' decoded values summed in row order, times ``factor`` (one row
    times 1: the dequantization). Grid axis 1 (k = 1): independent rows, row ``r`` read ``r`` strides on and written
    ``r * out_stride`` on (the row decode; in int64, so the rows may lie any distance apart)."""
    pid = tl.program_id(0)  # axis 0: chunks x blocks (axis 1 is capped at 65535 on CUDA)
    r = tl.program_id(1).to(tl.int64)
    q_ptr = q_ptr + r * q_stride
    mins_ptr = mins_ptr + r * mins_stride
    maxs_ptr = maxs_ptr + r * maxs_stride
    out_ptr = out_ptr + r * out_stride
    c = pid // nblk
    blk = pid % nblk
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = (offs < chunk_size) & (c * chunk_size + offs < numel)
    ones = tl.full((BLOCK,), 1.0, tl.float32)
    scale, lb = _params(tl.load(mins_ptr + c), tl.load(maxs_ptr + c))
    q = tl.load(q_ptr + c * chunk_size + offs, mask=ok, other=0).to(tl.float32)
    acc = tl.math.div_rn(q + lb, ones * scale)  # row 0 starts the sum (no 0 + d: d may be -0.0 for a bad row)
    for a in range(1, k):
        scale, lb = _params(tl.load(mins_ptr + a * mins_stride + c), tl.load(maxs_ptr + a * maxs_stride + c))
        q = tl.load(q_ptr + a * q_stride + c * chunk_size + offs, mask=ok, other=0).to(tl.float32)
        acc = acc + tl.math.div_rn(q + lb, ones * scale)
    acc = acc * factor
    tl.store(out_ptr + c * chunk_size + offs, to_out_dtype(acc, out_ptr.dtype.element_ty), mask=ok)
