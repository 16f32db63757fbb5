"""Triton kernels for ByteGrad's min-max UINT8 quantization.

A chunk is usually far larger than one program's tile (Bagua's default bucket is 10 MiB), so the per-chunk min/max
is a split reduction: every program reduces one ``BLOCK`` of one chunk, a tiny torch reduction finishes it, and the
per-chunk (scale, lb) come from the same torch function as the reference (so they are bit-identical). The quantize
and dequantize kernels are then elementwise over ``[chunks, blocks]`` grids.
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
def minmax_quantize_kernel(x_ptr, q_ptr, scale_ptr, lb_ptr, numel, chunk_size, nblk, BLOCK: tl.constexpr):
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
    tl.store(q_ptr + c * chunk_size + offs, y.to(tl.uint8), mask=ok)


@triton.jit
def minmax_dequantize_kernel(q_ptr, out_ptr, scale_ptr, lb_ptr, numel, chunk_size, nblk, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # 1-D grid of chunks x blocks (a 2-D grid's second axis is capped at 65535 on CUDA)
    c = pid // nblk
    blk = pid % nblk
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = (offs < chunk_size) & (c * chunk_size + offs < numel)
    scale = tl.load(scale_ptr + c)
    lb = tl.load(lb_ptr + c)
    q = tl.load(q_ptr + c * chunk_size + offs, mask=ok, other=0).to(tl.float32)
    y = tl.math.div_rn(q + lb, tl.full((BLOCK,), 1.0, tl.float32) * scale)
    tl.store(out_ptr + c * chunk_size + offs, to_out_dtype(y, out_ptr.dtype.element_ty), mask=ok)
