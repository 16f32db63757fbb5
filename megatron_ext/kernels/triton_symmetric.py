"""Triton kernels for block-wise symmetric quantization, the qgZ swizzle and the fused dequantize-reduce(-quantize).

One program handles ``GPP`` scale groups as a ``[GPP, group]`` tile kept in registers: the absmax, the scale and the
codes come from a single read of the input (seed 000 4.2). INT4 tiles are split into even / odd columns so the pair
that shares a byte is packed in registers. Numerics follow :mod:`.reference` exactly: IEEE division (``div_rn``),
round half to even, sequential fp32 accumulation; launches disable FMA contraction so GPU results stay bit-identical.
"""
from __future__ import annotations

import triton
import triton.language as tl

_TWO23 = 8388608.0  # 2^23: adding and subtracting it rounds |y| < 2^23 to an integer, half to even


@triton.jit
def rint(y):
    """Round half to even, as ``torch.round`` (pure fp32 arithmetic: works compiled and in the interpreter)."""
    a = tl.abs(y)
    r = (a + 8388608.0) - 8388608.0
    r = tl.where(a < 8388608.0, r, a)
    return tl.where(y < 0, -r, r)


@triton.jit
def to_out_dtype(y, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even; bf16 by hand (the interpreter's bf16 cast truncates). A NaN becomes
    0xFFFF, the NaN torch's CPU cast gives (the rounding add alone would carry CUDA's 0x7FFFFFFF into -0.0)."""
    if DTYPE == tl.bfloat16:
        u = y.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        u = tl.where(y != y, 0xFFFF, u)
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(DTYPE)


@triton.jit
def _group_scale(absmax, QMAX: tl.constexpr):
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    return scale, safe


@triton.jit
def _codes(v, safe, QMAX: tl.constexpr):
    """Clamped round-half-to-even of ``v / safe``, as int32, without a float-to-int conversion (a quarter-rate
    instruction on NVIDIA GPUs). Adding ``C = 1.5 * 2^23`` rounds ``y = v / safe`` to an integer, half to even, when
    |y| < 2^22; clamping ``y + C`` to ``[C - QMAX, C + QMAX]`` then gives the same code as ``clamp(rint(y))`` for every
    y (a larger |y|, possible only under a subnormal scale, lands beyond the clamp either way), and the code is the
    integer in the low bits of ``y + C``."""
    y = tl.math.div_rn(v, safe[:, None]) + 12582912.0
    y = tl.minimum(tl.maximum(y, 12582912.0 - QMAX), 12582912.0 + QMAX)
    return y.to(tl.int32, bitcast=True) - 0x4B400000  # the bits of 12582912.0


@triton.jit
def _small_int_to_float(u, BIAS: tl.constexpr):
    """fp32 of ``u - BIAS`` for ``0 <= u < 2^23`` (int32), without an int-to-float conversion: ``2^23 + u`` is
    exact in fp32 and its bits are ``0x4B000000 | u``."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)


@triton.jit
def _int4_pair(b):
    """The signed (even, odd) nibbles of packed bytes ``b`` (uint8), as fp32: ``nibble ^ 8`` is ``code + 8``."""
    u = b.to(tl.int32)
    return _small_int_to_float(((u >> 4) & 15) ^ 8, 8), _small_int_to_float((u & 15) ^ 8, 8)


@triton.jit
def _int8_value(c):
    """An int8 code as fp32: its byte ``^ 0x80`` is ``code + 128``."""
    return _small_int_to_float(c.to(tl.uint8, bitcast=True).to(tl.int32) ^ 128, 128)


@triton.jit
def _source(rows, e, numel, part_numel, stage_numel, gpc,
            NODES: tl.constexpr, RPN: tl.constexpr):
    """Source offsets and validity of element ``e`` (within its chunk) of output groups ``rows`` (qgZ layout)."""
    chunk = rows // gpc
    s = chunk // (NODES * RPN)
    j = chunk % (NODES * RPN)
    p = (j % NODES) * RPN + j // NODES
    in_part = s[:, None] * stage_numel + e
    src = p[:, None] * part_numel + in_part
    ok = (e < stage_numel) & (in_part < part_numel) & (src < numel)
    return src, ok


@triton.jit
def swizzle_quantize_kernel(x_ptr, codes_ptr, scales_ptr, numel, part_numel, stage_numel, total_groups, gpc,
                            gpr, code_row_stride, scale_row_stride,
                            NODES: tl.constexpr, RPN: tl.constexpr, GROUP: tl.constexpr,
                            COLS: tl.constexpr, GPP: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr):
    """Quantize output groups ``[pid*GPP, pid*GPP+GPP)`` gathered from ``x`` in qgZ slot order.

    Plain ``quantize_symmetric`` is the special case NODES = RPN = 1, part_numel = stage_numel = numel.
    ``gpc`` (groups per chunk) is a run-time argument: it changes with every bucket size, and as a constexpr each new
    size would compile a new kernel. Output group ``t`` goes to row ``t // gpr`` of codes and scales, rows
    ``code_row_stride`` / ``scale_row_stride`` apart (wire rows written in place; one row: contiguous output).
    COLS = next power of two of GROUP (8 bit) or GROUP // 2 (4 bit).
    """
    pid = tl.program_id(0)
    rows = pid * GPP + tl.arange(0, GPP)
    row_ok = rows < total_groups
    cols = tl.arange(0, COLS)
    base = (rows % gpc) * GROUP
    orow = rows // gpr
    ogrp = rows - orow * gpr
    if BITS == 8:
        col_ok = cols < GROUP
        e = base[:, None] + cols[None, :]
        src, ok = _source(rows, e, numel, part_numel, stage_numel, gpc, NODES, RPN)
        ok = ok & row_ok[:, None] & col_ok[None, :]
        v = tl.load(x_ptr + src, mask=ok, other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(v), axis=1)
        scale, safe = _group_scale(absmax, QMAX)
        q = _codes(v, safe, QMAX)
        dst = (orow * code_row_stride + ogrp * GROUP)[:, None] + cols[None, :]
        tl.store(codes_ptr + dst, q.to(tl.int8), mask=row_ok[:, None] & col_ok[None, :])
    else:
        col_ok = cols < GROUP // 2
        e0 = base[:, None] + 2 * cols[None, :]
        src0, ok0 = _source(rows, e0, numel, part_numel, stage_numel, gpc, NODES, RPN)
        src1, ok1 = _source(rows, e0 + 1, numel, part_numel, stage_numel, gpc, NODES, RPN)
        m2 = row_ok[:, None] & col_ok[None, :]
        v0 = tl.load(x_ptr + src0, mask=ok0 & m2, other=0.0).to(tl.float32)
        v1 = tl.load(x_ptr + src1, mask=ok1 & m2, other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(v0), axis=1), tl.max(tl.abs(v1), axis=1))
        scale, safe = _group_scale(absmax, QMAX)
        q0 = _codes(v0, safe, QMAX)
        q1 = _codes(v1, safe, QMAX)
        byte = ((q0 & 15) << 4) | (q1 & 15)
        dst = (orow * code_row_stride + ogrp * (GROUP // 2))[:, None] + cols[None, :]
        tl.store(codes_ptr + dst, byte.to(tl.uint8), mask=m2)
    tl.store(scales_ptr + orow * scale_row_stride + ogrp, scale, mask=row_ok)


@triton.jit
def reduce_kernel(chunks_ptr, scales_ptr, out_ptr, out_codes_ptr, out_scales_ptr, groups, numel, factor,
                  chunk_stride, scale_stride, row_stride, scale_row_stride, out_row_stride,
                  out_gpr, out_code_row_stride, out_scale_row_stride,
                  K: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr, GPP: tl.constexpr, BITS: tl.constexpr,
                  QMAX: tl.constexpr, REQUANT: tl.constexpr):
    """Sum over the ``K`` chunks of ``fl(code * scale)``, in order; chunk ``i`` starts ``i * chunk_stride`` code
    elements (``i * scale_stride`` scales) in, so the chunks may be rows of a received byte buffer, read in place.

    REQUANT: quantize the sum into ``out_codes``/``out_scales`` (group ``t`` in row ``t // out_gpr``, rows
    ``out_code_row_stride`` / ``out_scale_row_stride`` apart: wire rows written in place); else store its first
    ``numel`` elements times ``factor`` (fp32; 1.0 is exact) to ``out``.
    Dequantization alone is the case K = 1. K (nodes or ranks per node) is a constexpr so that the loop unrolls and
    the K loads are all in flight before the first is used. Grid axis 1 runs independent problems (rows of a
    gathered buffer): problem ``r`` reads from ``r * row_stride`` / ``r * scale_row_stride`` and writes ``out`` from
    ``r * out_row_stride``.
    """
    r = tl.program_id(1)
    chunks_ptr += r * row_stride
    scales_ptr += r * scale_row_stride
    out_ptr += r * out_row_stride
    pid = tl.program_id(0)
    rows = pid * GPP + tl.arange(0, GPP)
    row_ok = rows < groups
    cols = tl.arange(0, COLS)
    if BITS == 8:
        col_ok = cols < GROUP
        m2 = row_ok[:, None] & col_ok[None, :]
        off = rows[:, None] * GROUP + cols[None, :]
        acc = tl.zeros((GPP, COLS), dtype=tl.float32)
        for i in tl.static_range(K):
            sc = tl.load(scales_ptr + i * scale_stride + rows, mask=row_ok, other=0.0)
            c = _int8_value(tl.load(chunks_ptr + i * chunk_stride + off, mask=m2, other=0))
            acc += c * sc[:, None]
        if REQUANT:
            absmax = tl.max(tl.abs(acc), axis=1)
            scale, safe = _group_scale(absmax, QMAX)
            q = _codes(acc, safe, QMAX)
            orow = rows // out_gpr
            ogrp = rows - orow * out_gpr
            dst = (orow * out_code_row_stride + ogrp * GROUP)[:, None] + cols[None, :]
            tl.store(out_codes_ptr + dst, q.to(tl.int8), mask=m2)
            tl.store(out_scales_ptr + orow * out_scale_row_stride + ogrp, scale, mask=row_ok)
        else:
            tl.store(out_ptr + off, to_out_dtype(acc * factor, out_ptr.dtype.element_ty), mask=m2 & (off < numel))
    else:
        col_ok = cols < GROUP // 2
        m2 = row_ok[:, None] & col_ok[None, :]
        off = rows[:, None] * (GROUP // 2) + cols[None, :]
        acc0 = tl.zeros((GPP, COLS), dtype=tl.float32)
        acc1 = tl.zeros((GPP, COLS), dtype=tl.float32)
        for i in tl.static_range(K):
            sc = tl.load(scales_ptr + i * scale_stride + rows, mask=row_ok, other=0.0)
            hi, lo = _int4_pair(tl.load(chunks_ptr + i * chunk_stride + off, mask=m2, other=0))
            acc0 += hi * sc[:, None]
            acc1 += lo * sc[:, None]
        if REQUANT:
            absmax = tl.maximum(tl.max(tl.abs(acc0), axis=1), tl.max(tl.abs(acc1), axis=1))
            scale, safe = _group_scale(absmax, QMAX)
            q0 = _codes(acc0, safe, QMAX)
            q1 = _codes(acc1, safe, QMAX)
            byte = ((q0 & 15) << 4) | (q1 & 15)
            orow = rows // out_gpr
            ogrp = rows - orow * out_gpr
            dst = (orow * out_code_row_stride + ogrp * (GROUP // 2))[:, None] + cols[None, :]
            tl.store(out_codes_ptr + dst, byte.to(tl.uint8), mask=m2)
            tl.store(out_scales_ptr + orow * out_scale_row_stride + ogrp, scale, mask=row_ok)
        else:
            # interleave the even and odd elements in registers: one contiguous store instead of two stride-2 ones
            # (strided fp32 stores ran at a quarter of the copy bandwidth on an H100)
            both = tl.reshape(tl.join(to_out_dtype(acc0 * factor, out_ptr.dtype.element_ty),
                                      to_out_dtype(acc1 * factor, out_ptr.dtype.element_ty)), (GPP, 2 * COLS))
            e = rows[:, None] * GROUP + tl.arange(0, 2 * COLS)[None, :]
            ok = row_ok[:, None] & (tl.arange(0, 2 * COLS) < GROUP)[None, :] & (e < numel)
            tl.store(out_ptr + e, both, mask=ok)
