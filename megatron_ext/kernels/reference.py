"""Torch reference implementations: the specification of every kernel, run eagerly.

On CPU it runs when ``MX_KERNELS=torch`` or ``MX_KERNELS_COMPILE=0``, and for tensors below the compiled path's size
threshold that :mod:`.native` does not serve (it takes fp32 at every size where its vector build exists);
:mod:`.compiled` generates fused loops from the same math. Numerics are defined here and reproduced bit
for bit by the compiled CPU path and the Triton kernels:
  * all arithmetic in fp32; ``fl(a / b)`` is an IEEE division (never a multiplication by a reciprocal);
  * rounding is round-half-to-even (``torch.round``);
  * reductions over ``k`` received chunks accumulate sequentially, ``acc = ((0 + d_0) + d_1) + ...``, where
    ``d_i = fl(code * scale)`` (no fused multiply-add).

Speed (CPU): every op works on blocks of ``_BLOCK`` elements so that the fp32 temporaries between the passes stay in
cache; DRAM sees roughly one read of the input and one write of the output, which is what the benchmark compares with
a memory copy.
"""
from __future__ import annotations

import sys

import torch

from .layout import (SwizzleLayout, cdiv, check_bits_group, check_codes, check_contiguous, check_disjoint,
                     check_input, check_rows, check_rows_apart,
                     check_minmax_codes, codes_dtype, num_groups, qmax, swizzle_layout)

_BLOCK = 1 << 18  # elements per cache block (1 MiB of fp32: one core's L2)
_ONE_BLOCK_MAX = 2 * _BLOCK  # padded sizes up to this are (de)quantized as one zero-padded block (see _quantize_padded)
_TINY = 2.0 ** -126  # smallest normal fp32
_MINMAX_EPS = 1e-7  # ByteGrad: scale = 255 / (max - min + 1e-7)


# ----------------------------------------------------------------------------------------------------------------
# INT4 nibble packing
# ----------------------------------------------------------------------------------------------------------------
_LITTLE = sys.byteorder == "little"


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 codes in [-8, 7] two per byte: element 2i in bits 4-7, element 2i+1 in bits 0-3."""
    if _LITTLE:  # one int16 lane per pair: low byte = even element, high byte = odd element (3x fewer passes)
        v = q.reshape(-1).view(torch.int16)
        return (((v & 0x0F) << 4) | ((v >> 8) & 0x0F)).to(torch.uint8)
    u = q.view(torch.uint8).view(-1, 2)
    return (u[:, 0] << 4) | (u[:, 1] & 0x0F)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: signed int8 codes, two per input byte."""
    if _LITTLE:  # build the int16 lane (odd << 8) | (even & 0xFF) with sign-extended nibbles, then view as int8
        w = packed.view(torch.int8).to(torch.int16)
        return (((w >> 4) & 0xFF) | ((w << 12) >> 4)).view(torch.int8)
    hi = packed.view(torch.int8) >> 4
    lo = (packed << 4).view(torch.int8) >> 4
    return torch.stack((hi, lo), dim=-1).view(-1)


# ----------------------------------------------------------------------------------------------------------------
# Block-wise symmetric quantization
# ----------------------------------------------------------------------------------------------------------------
def _quantize_groups(xg: torch.Tensor, bits: int, scales_out: torch.Tensor, codes_out: torch.Tensor) -> None:
    """Quantize ``xg`` of shape [k, group_size] (any float dtype) into ``scales_out[k]`` and ``codes_out``."""
    qm = qmax(bits)
    # amax and amin separately: two cheap reductions (torch.aminmax over dim=1 is ~10x slower on CPU)
    absmax = torch.maximum(xg.amax(dim=1), xg.amin(dim=1).neg_()).float().abs_()  # abs_: +0.0 for all-zero groups
    # a tensor divisor: CUDA divides by a Python scalar as a multiplication by its reciprocal (not IEEE division)
    torch.div(absmax, torch.full_like(absmax, qm), out=scales_out)
    safe = torch.where(scales_out > 0, scales_out, torch.ones_like(scales_out))  # all-zero group: codes 0, scale 0
    if xg.dtype == torch.float32:
        y = torch.div(xg, safe.unsqueeze(1))
    else:  # exact upcast first: mixed-dtype broadcasting is slow on CPU
        y = xg.float().div_(safe.unsqueeze(1))
    y.round_()
    if bool(((scales_out > 0) & (scales_out < _TINY)).any()):  # |x/scale| <= qmax unless the scale is subnormal
        y.clamp_(-qm, qm)
    if bits == 8:
        codes_out.copy_(y.view(-1))
    else:
        codes_out.copy_(pack_int4(y.to(torch.int8)))


def _quantize_padded(flat: torch.Tensor, numel: int, bits: int, group_size: int,
                     codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``flat[:numel]`` zero-padded to ``scales.numel() * group_size`` elements into ``codes``/``scales``."""
    g = group_size
    total = scales.numel()
    if numel < total * g <= _ONE_BLOCK_MAX:
        # A bucket-sized input with a partial last group (qwZ's shards: balanced groups rarely divide them): one
        # zero-padded copy and one pass instead of the whole groups plus the padded rest, ~35% less host time per
        # call at 100k elements, where the ops' fixed costs outweigh their data. Every group is quantized alone, so
        # the bits are the same.
        block = torch.zeros(total * g, dtype=flat.dtype, device=flat.device)
        block[:numel] = flat[:numel]
        _quantize_groups(block.view(total, g), bits, scales, codes)
        return
    full = numel // g
    per_block = max(1, _BLOCK // g)
    bpg = g * bits // 8  # code bytes per group
    for s in range(0, full, per_block):
        e = min(full, s + per_block)
        _quantize_groups(flat[s * g:e * g].view(e - s, g), bits, scales[s:e], codes[s * bpg:e * bpg])
    if total > full:  # partial last group and/or whole padding groups
        tail = torch.zeros((total - full) * g, dtype=flat.dtype, device=flat.device)
        tail[:numel - full * g] = flat[full * g:numel]
        _quantize_groups(tail.view(-1, g), bits, scales[full:], codes[full * bpg:])


def quantize_symmetric(x: torch.Tensor, *, bits: int, group_size: int,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_input(x)
    check_bits_group(bits, group_size)
    numel = x.numel()
    groups = num_groups(numel, group_size)
    if out is not None:
        check_out_rows(out, bits, groups * group_size * bits // 8, groups, (x,))
    codes = torch.empty(groups * group_size * bits // 8, dtype=codes_dtype(bits), device=x.device)
    scales = torch.empty(groups, dtype=torch.float32, device=x.device)
    _quantize_padded(x.view(-1), numel, bits, group_size, codes, scales)
    return into_rows(codes, scales, out)


def _dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """``out[k, g] = fl(code * scale)`` cast to ``out.dtype``; ``codes`` are the bytes of those k groups."""
    f32 = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    q = codes if bits == 8 else unpack_int4(codes)
    f32.copy_(q.view(out.shape))  # int8 -> fp32 is exact; same-dtype math below takes the fast path
    f32.mul_(scales.unsqueeze(1))
    if f32 is not out:
        out.copy_(f32)


def check_dequantize_args(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int) -> int:
    """Validate ``dequantize_symmetric``'s arguments (both backends); returns the number of groups."""
    check_bits_group(bits, group_size)
    check_codes(codes, bits)
    check_contiguous(scales, "scales")
    groups = num_groups(numel, group_size)
    if scales.numel() < groups or codes.numel() * 8 // bits < groups * group_size:
        raise ValueError(f"{numel} elements need {groups} groups of {group_size}: got {scales.numel()} scales and "
                         f"{codes.numel()} code bytes")
    return groups


def dequantize_symmetric(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int, numel: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    check_dequantize_args(codes, scales, bits, group_size, numel)
    g = group_size
    scales = scales.view(-1).float()
    codes = codes.view(-1)
    full = numel // g
    bpg = g * bits // 8
    groups = cdiv(numel, g)
    if numel < groups * g <= _ONE_BLOCK_MAX:   # partial last group, bucket-sized: one pass (as _quantize_padded)
        out = torch.empty(groups * g, dtype=dtype, device=codes.device)
        _dequantize_groups(codes[:groups * bpg], scales[:groups], bits, out.view(groups, g))
        return out[:numel]
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    per_block = max(1, _BLOCK // g)
    for s in range(0, full, per_block):
        e = min(full, s + per_block)
        _dequantize_groups(codes[s * bpg:e * bpg], scales[s:e], bits, out[s * g:e * g].view(e - s, g))
    if numel > full * g:
        tmp = torch.empty(1, g, dtype=dtype, device=codes.device)
        _dequantize_groups(codes[full * bpg:(full + 1) * bpg], scales[full:full + 1], bits, tmp)
        out[full * g:] = tmp.view(-1)[:numel - full * g]
    return out


def check_rows_args(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, out: torch.Tensor
                    ) -> tuple[int, int, int]:
    """Validate ``dequantize_rows``'s arguments (every backend); returns ``(rows, groups per row, out row length)``."""
    check_bits_group(bits, group_size)
    check_codes(codes, bits, "codes", rows=True)
    check_rows(scales, "scales")
    check_rows(out, "out")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {scales.dtype}")
    if out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out must be float32, float16 or bfloat16, got {out.dtype}")
    if out.device != codes.device or scales.device != codes.device:
        raise ValueError(f"scales and out must be on codes' device {codes.device}, got {scales.device} and "
                         f"{out.device}")
    rows, groups, n = codes.shape[0], scales.shape[1], out.shape[1]
    if scales.shape[0] != rows or out.shape[0] != rows:
        raise ValueError(f"codes, scales and out must have the same rows; got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)} and {tuple(out.shape)}")
    check_rows_apart(out, "out's")
    check_disjoint((out,), (codes, scales))
    if groups * group_size * bits // 8 != codes.shape[1] or n > groups * group_size:
        raise ValueError(f"a row of {groups} groups of {group_size} {bits}-bit codes is "
                         f"{groups * group_size * bits // 8} bytes and decodes to at most {groups * group_size} "
                         f"elements; got {codes.shape[1]} bytes and out rows of {n}")
    return rows, groups, n


def check_out_rows(out: tuple[torch.Tensor, torch.Tensor], bits: int, code_bytes: int, groups: int,
                   inputs: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """Validate a quantizing op's ``out=(codes [R, code_bytes/R], scales [R, groups/R] fp32)`` (every backend):
    the result split into R equal parts of whole groups, one per row, each row contiguous, rows at any stride (the
    ``[codes | scales]`` rows a backend sends, written in place), on the device of the op's ``inputs`` and clear of
    their memory. Returns ``(R, groups per row)``."""
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError("out must be a (codes, scales) pair of tensors")
    device = inputs[0].device
    oc, os_ = out
    check_codes(oc, bits, "out codes", rows=True)
    check_rows(os_, "out scales")
    if os_.dtype != torch.float32:
        raise TypeError(f"out scales must be float32, got {os_.dtype}")
    if oc.device != device or os_.device != device:
        raise ValueError(f"out must be on {device}, got {oc.device} and {os_.device}")
    rows = oc.shape[0]
    if rows < 1 or os_.shape[0] != rows or rows * oc.shape[1] != code_bytes or rows * os_.shape[1] != groups:
        raise ValueError(f"out must split {code_bytes} code bytes and {groups} scales into equal rows; got codes "
                         f"{tuple(oc.shape)} and scales {tuple(os_.shape)}")
    for t, name in ((oc, "codes"), (os_, "scales")):
        check_rows_apart(t, f"out {name}'")
    check_disjoint(out, inputs)
    return rows, os_.shape[1]


def into_rows(codes: torch.Tensor, scales: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None):
    """``(codes, scales)``, or with ``out`` (checked by :func:`check_out_rows`) both copied into its rows and
    ``out`` returned: the backends that cannot write rows in place give the same bytes through one copy each."""
    if out is None:
        return codes, scales
    oc, os_ = out
    oc.copy_(codes.view(oc.shape[0], -1))
    os_.copy_(scales.view(os_.shape[0], -1))
    return out


def dequantize_rows_with(dequantize, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                         out: torch.Tensor) -> torch.Tensor:
    """``dequantize_rows`` by one flat ``dequantize`` call: every row holds whole groups, so group boundaries are row
    boundaries and each element decodes as a per-row call would decode it."""
    rows, groups, n = check_rows_args(codes, scales, bits, group_size, out)
    if rows and n:
        padded = groups * group_size
        flat = dequantize(codes.contiguous().view(-1), scales.contiguous().view(-1), bits=bits,
                          group_size=group_size, numel=rows * padded, dtype=out.dtype)
        out.copy_(flat.view(rows, padded)[:, :n])
    return out


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
                    out: torch.Tensor) -> torch.Tensor:
    return dequantize_rows_with(dequantize_symmetric, codes, scales, bits, group_size, out)


# ----------------------------------------------------------------------------------------------------------------
# qgZ: swizzle + quantize, dequantize + reduce (+ requantize)
# ----------------------------------------------------------------------------------------------------------------
def swizzle_gather(x: torch.Tensor, lay: SwizzleLayout) -> torch.Tensor:
    """The reordered, zero-padded input as ``[S, W, chunk_numel]`` (a copy in ``x.dtype``)."""
    n_, d_, s_ = lay.nodes, lay.ranks_per_node, lay.stages
    n, m = lay.partition_numel, lay.stage_numel
    out = torch.zeros(s_, d_, n_, lay.chunk_numel, dtype=x.dtype, device=x.device)
    flat = x.view(-1)
    if lay.numel == lay.world * n and n == s_ * m:  # no padding between partitions or stages: one strided copy
        out[..., :m].copy_(flat.view(n_, d_, s_, m).permute(2, 1, 0, 3))
        return out.view(s_, lay.world, lay.chunk_numel)
    for p in range(lay.world):
        a, b = divmod(p, d_)
        for s in range(s_):
            start = p * n + s * m
            stop = min(p * n + min(n, (s + 1) * m), lay.numel)
            if stop > start:
                out[s, b, a, :stop - start] = flat[start:stop]
    return out.view(s_, lay.world, lay.chunk_numel)


def swizzle_quantize(x: torch.Tensor, bits: int, group_size: int, nodes: int, ranks_per_node: int,
                     pipeline_stages: int = 1, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    check_input(x)
    lay = swizzle_layout(x.numel(), bits, group_size, nodes, ranks_per_node, pipeline_stages)
    if out is not None:
        check_out_rows(out, bits, lay.total_code_bytes, lay.total_groups, (x,))
    codes = torch.empty(lay.codes_shape, dtype=codes_dtype(bits), device=x.device)
    scales = torch.empty(lay.scales_shape, dtype=torch.float32, device=x.device)
    flat = x.view(-1)
    padded = lay.stages * lay.world * lay.chunk_numel
    if padded <= _ONE_BLOCK_MAX:
        # A bucket-sized input (the ODO's per-bucket call): its W*S chunks copied into one zero-padded block and
        # quantized in one pass, 2-3x faster than chunk by chunk, where each chunk's partial last group (padded on
        # its own) costs more ops than the chunk's data. Every group is quantized alone: the same bits either way.
        _quantize_padded(swizzle_gather(x, lay).view(-1), padded, bits, group_size, codes.view(-1),
                         scales.view(-1))
        return into_rows(codes, scales, out)
    # Every stage chunk is contiguous in x: quantize it straight into its slot (the reorder costs no extra pass).
    for s, j, start, stop in _swizzle_chunks(lay):
        _quantize_padded(flat[start:stop], stop - start, bits, group_size, codes[s, j], scales[s, j])
    return into_rows(codes, scales, out)


def _swizzle_chunks(lay: SwizzleLayout):
    """``(stage, slot, start, stop)`` of every stage chunk: slot ``j`` holds partition ``(j % N) * D + j // N``."""
    n, m = lay.partition_numel, lay.stage_numel
    for s in range(lay.stages):
        for j in range(lay.world):
            p = (j % lay.nodes) * lay.ranks_per_node + j // lay.nodes
            start = min(p * n + s * m, lay.numel)
            yield s, j, start, min(p * n + s * m + lay.stage_valid_numel(s), lay.numel)


def check_chunks(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> tuple[int, int]:
    """Validate the ``[k, bytes]`` chunks and ``[k, groups]`` scales of the reduce ops (every backend). Each row
    is contiguous, the rows at any stride: the chunks of a received all-to-all buffer are read where they lie."""
    check_bits_group(bits, group_size)
    if chunks.dim() != 2 or scales.dim() != 2 or scales.shape[0] != chunks.shape[0]:
        raise ValueError(f"chunks must be [k, bytes] and scales [k, groups]; got {tuple(chunks.shape)} and "
                         f"{tuple(scales.shape)}")
    check_codes(chunks, bits, "chunks", rows=True)
    check_rows(scales, "scales")
    k, nbytes = chunks.shape
    groups = scales.shape[1]
    if k < 1:
        raise ValueError("chunks must hold at least one chunk (k >= 1), got k = 0")
    if groups * group_size * bits // 8 != nbytes:
        raise ValueError(f"{groups} groups of {group_size} {bits}-bit codes are {groups * group_size * bits // 8} "
                         f"bytes per chunk, got {nbytes}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {scales.dtype}")
    return k, groups


def _reduce_block(chunks: torch.Tensor, scales: torch.Tensor, bits: int, g0: int, g1: int, group_size: int,
                  acc: torch.Tensor) -> None:
    """``acc[g1-g0, group_size]`` = sequential fp32 sum over the k rows of groups [g0, g1)."""
    bpg = group_size * bits // 8
    # row 0 straight into acc: 0 + d_0 == d_0 bit for bit (fl(code * scale) is never -0.0: code 0 gives +0.0)
    _dequantize_groups(chunks[0, g0 * bpg:g1 * bpg], scales[0, g0:g1], bits, acc)
    d = torch.empty_like(acc) if chunks.shape[0] > 1 else acc
    for i in range(1, chunks.shape[0]):
        _dequantize_groups(chunks[i, g0 * bpg:g1 * bpg], scales[i, g0:g1], bits, d)
        acc.add_(d)


def dequantize_reduce_quantize(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                               out: tuple[torch.Tensor, torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    k, groups = check_chunks(chunks, scales, bits, group_size)
    if out is not None:
        check_out_rows(out, bits, chunks.shape[1], groups, (chunks, scales))
    codes = torch.empty(chunks.shape[1], dtype=chunks.dtype, device=chunks.device)
    out_scales = torch.empty(groups, dtype=torch.float32, device=chunks.device)
    per_block = max(1, _BLOCK // group_size)
    bpg = group_size * bits // 8
    for s in range(0, groups, per_block):
        e = min(groups, s + per_block)
        acc = torch.empty(e - s, group_size, dtype=torch.float32, device=chunks.device)
        _reduce_block(chunks, scales, bits, s, e, group_size, acc)
        _quantize_groups(acc, bits, out_scales[s:e], codes[s * bpg:e * bpg])
    return into_rows(codes, out_scales, out)


def check_reduce_args(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int | None,
                      dtype: torch.dtype, out: torch.Tensor | None) -> tuple[int, int, int]:
    """Validate ``dequantize_reduce``'s arguments (every backend); returns ``(k, groups, numel)``."""
    k, groups = check_chunks(chunks, scales, bits, group_size)
    total = groups * group_size
    numel = total if numel is None else numel
    if numel > total:
        raise ValueError(f"numel={numel} exceeds the {total} elements held by each chunk")
    check_result(dtype, out, numel, (chunks, scales))
    return k, groups, numel


def dequantize_reduce(chunks: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
                      numel: int | None = None, dtype: torch.dtype = torch.float32, factor: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    k, groups, numel = check_reduce_args(chunks, scales, bits, group_size, numel, dtype, out)
    given, out = out, (torch.empty(numel, dtype=dtype, device=chunks.device) if out is None else out.view(-1))
    per_block = max(1, _BLOCK // group_size)
    for s in range(0, groups, per_block):
        e = min(groups, s + per_block)
        lo, hi = s * group_size, min(numel, e * group_size)
        if hi <= lo:
            break
        whole = dtype == torch.float32 and hi - lo == (e - s) * group_size   # whole groups: sum straight into out
        acc = (out[lo:hi] if whole else torch.empty((e - s) * group_size, dtype=torch.float32, device=chunks.device))
        _reduce_block(chunks, scales, bits, s, e, group_size, acc.view(e - s, group_size))
        if factor != 1.0:
            acc.mul_(factor)   # fp32: the sum times fl32(factor), then cast
        if not whole:
            out[lo:hi] = acc[:hi - lo]
    return out if given is None else given


# ----------------------------------------------------------------------------------------------------------------
# ByteGrad min-max UINT8
# ----------------------------------------------------------------------------------------------------------------
def minmax_params(mins: torch.Tensor, maxs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ByteGrad's (scale, lb) per chunk, in fp32: scale = 255/(max-min+1e-7), lb = rint(max*scale) - 255."""
    scale = 255.0 / ((maxs - mins) + _MINMAX_EPS)
    lb = torch.round(maxs * scale) - 255.0
    return scale, lb


def _chunk_minmax(flat: torch.Tensor, numel: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    nchunks = cdiv(numel, chunk_size)
    mins = torch.empty(nchunks, dtype=torch.float32, device=flat.device)
    maxs = torch.empty_like(mins)
    full = numel // chunk_size
    if full:  # amin / amax separately: torch.aminmax over dim=1 is ~10x slower on CPU
        body = flat[:full * chunk_size].view(full, chunk_size)
        mins[:full], maxs[:full] = body.amin(dim=1), body.amax(dim=1)
    if nchunks > full:
        tail = flat[full * chunk_size:numel]
        mins[full], maxs[full] = tail.amin(), tail.amax()
    return mins, maxs


def _row_blocks(numel: int, chunk_size: int):
    """Yield (start, stop, rows, chunk0): element ranges covering whole chunks (or pieces of one big chunk).

    ``rows`` > 0: ``[start, stop)`` is ``rows`` full chunks starting at chunk ``chunk0``; ``rows`` == 0: a piece of
    chunk ``chunk0`` (a chunk larger than a cache block, or the partial last chunk).
    """
    full = numel // chunk_size
    per = _BLOCK // chunk_size
    if per >= 1:
        for c in range(0, full, per):
            r = min(per, full - c)
            yield c * chunk_size, (c + r) * chunk_size, r, c
        if numel > full * chunk_size:
            yield full * chunk_size, numel, 0, full
        return
    for c in range(cdiv(numel, chunk_size)):
        c1 = min(numel, (c + 1) * chunk_size)
        for s in range(c * chunk_size, c1, _BLOCK):
            yield s, min(c1, s + _BLOCK), 0, c


def check_minmax_out_rows(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor, chunk_size: int
                          ) -> tuple[int, int, int]:
    """Validate ``quantize_minmax_uint8``'s ``out=(q [R, n], mins [R, chunks], maxs [R, chunks])`` (every backend):
    the ``numel`` codes split into R rows of whole chunks (a single row may end in a partial chunk), each row
    contiguous, rows at any stride (the ``[q | pad | mins | maxs]`` rows ByteGrad sends, written in place), on
    ``x``'s device and clear of its memory. Returns ``(R, elements per row, chunks per row)``."""
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError("out must be a (q, mins, maxs) triple of tensors")
    q, mins, maxs = out
    if q.dtype != torch.uint8:
        raise TypeError(f"out q (min-max codes) must be torch.uint8, got {q.dtype}")
    for t, name in ((q, "q"), (mins, "mins"), (maxs, "maxs")):
        check_rows(t, f"out {name}")
        if name != "q" and t.dtype != torch.float32:
            raise TypeError(f"out {name} must be float32, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"out must be on {x.device}, got {t.device}")
    rows, n = q.shape
    per = cdiv(n, chunk_size)
    if (rows < 1 or rows * n != x.numel() or (rows > 1 and n % chunk_size)
            or tuple(mins.shape) != (rows, per) or tuple(maxs.shape) != (rows, per)):
        raise ValueError(f"out must split {x.numel()} codes into equal rows of whole {chunk_size}-element chunks (one "
                         f"row may end in a partial chunk), with a min and a max per chunk; got q {tuple(q.shape)}, "
                         f"mins {tuple(mins.shape)} and maxs {tuple(maxs.shape)}")
    for t, name in ((q, "q"), (mins, "mins"), (maxs, "maxs")):
        check_rows_apart(t, f"out {name}'")
    check_disjoint(out, (x,))
    return rows, n, per


def into_minmax_rows(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor,
                     out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None):
    """``(q, mins, maxs)``, or with ``out`` (checked by :func:`check_minmax_out_rows`) each copied into its rows and
    ``out`` returned."""
    if out is None:
        return q, mins, maxs
    for src, dst in zip((q, mins, maxs), out):
        dst.copy_(src.view(dst.shape))
    return out


def quantize_minmax_uint8(x: torch.Tensor, chunk_size: int,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_input(x)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if out is not None:
        check_minmax_out_rows(out, x, chunk_size)
    numel = x.numel()
    flat = x.view(-1)
    mins, maxs = _chunk_minmax(flat, numel, chunk_size)
    scale, lb = minmax_params(mins, maxs)
    ub = lb + 255.0
    # q = min(rint(x*scale), ub) - lb. The clamp to [0, 255] is ours: with ties (e.g. max - min = 2, scale = 127.5)
    # rint(min*scale) can be lb - 1, which ByteGrad's uint8 cast wraps to 255; clamping gives the nearest code.
    # Fast path: rint(fl(x*scale)) is monotone in x, so if the chunk minimum lands in [lb, ub] with exact integers
    # (< 2^24), every element does, and both the min() with ub and the clamp are no-ops: skip those two passes.
    rmin = torch.round(mins * scale)
    exact = bool(((rmin >= lb) & (ub.abs() < 2.0 ** 24) & (rmin.abs() < 2.0 ** 24)).all()) if numel else True
    q = torch.empty(numel, dtype=torch.uint8, device=x.device)
    for start, stop, rows, c in _row_blocks(numel, chunk_size):
        shape = (rows, chunk_size) if rows else (1, stop - start)
        k = max(rows, 1)
        sc, l_, u_ = scale[c:c + k, None], lb[c:c + k, None], ub[c:c + k, None]
        xs = flat[start:stop].view(shape)
        y = torch.mul(xs, sc) if flat.dtype == torch.float32 else xs.float().mul_(sc)
        y.round_()
        if not exact:
            torch.minimum(y, u_, out=y)
        y.sub_(l_)
        if not exact:  # nan (inf - inf: an overflowing chunk, see quantize_minmax_uint8's docstring) -> code 0
            y.nan_to_num_(nan=0.0).clamp_(0.0, 255.0)
        q[start:stop].view(shape).copy_(y)
    return into_minmax_rows(q, mins, maxs, out)


def check_minmax_dequantize_args(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int,
                                 numel: int) -> None:
    """The codes and per-chunk minima and maxima cover ``numel`` elements (shared by every dequantize_minmax_uint8
    path)."""
    check_minmax_codes(q)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if q.numel() < numel or min(mins.numel(), maxs.numel()) < cdiv(numel, chunk_size):
        raise ValueError(f"{numel} elements need {cdiv(numel, chunk_size)} chunks of {chunk_size}: got "
                         f"{q.numel()} codes, {mins.numel()} mins and {maxs.numel()} maxs")


def dequantize_minmax_uint8(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    check_minmax_dequantize_args(q, mins, maxs, chunk_size, numel)
    scale, lb = minmax_params(mins.float(), maxs.float())
    flat = q.view(-1)
    out = torch.empty(numel, dtype=dtype, device=q.device)
    for start, stop, rows, c in _row_blocks(numel, chunk_size):
        dst = out[start:stop].view(_block_shape(start, stop, rows, chunk_size))
        y = dst if dtype == torch.float32 else torch.empty_like(dst, dtype=torch.float32)
        _decode_minmax_block(flat[start:stop], scale, lb, c, y)
        if y is not dst:
            dst.copy_(y)
    return out


def _block_shape(start: int, stop: int, rows: int, chunk_size: int) -> tuple[int, int]:
    """The shape a :func:`_row_blocks` block is worked on in: its whole chunks as rows, or one row."""
    return (rows, chunk_size) if rows else (1, stop - start)


def _decode_minmax_block(q: torch.Tensor, scale: torch.Tensor, lb: torch.Tensor, chunk0: int, y: torch.Tensor) -> None:
    """``y`` (fp32, the block's shape) = ``(q + lb) / scale`` of a block's codes, its rows from chunk ``chunk0``."""
    k = y.shape[0]
    y.copy_(q.view(y.shape))
    y.add_(lb[chunk0:chunk0 + k, None]).div_(scale[chunk0:chunk0 + k, None])


def check_minmax_rows(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                      dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> int:
    """Validate ``dequantize_minmax_reduce``'s ``k`` rows (every backend; each row contiguous, the rows at any
    stride: the rows of a received byte buffer, read where they lie) and its ``out``. Returns ``k``."""
    if q.dtype != torch.uint8:
        raise TypeError(f"q (min-max codes) must be torch.uint8, got {q.dtype}")
    check_rows(q, "q")
    for t, name in ((mins, "mins"), (maxs, "maxs")):
        check_rows(t, name)
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    k = q.shape[0]
    if k < 1 or mins.shape[0] != k or maxs.shape[0] != k:
        raise ValueError(f"q, mins and maxs must hold the same k >= 1 rows; got {tuple(q.shape)}, "
                         f"{tuple(mins.shape)} and {tuple(maxs.shape)}")
    if numel < 0 or q.shape[1] < numel or min(mins.shape[1], maxs.shape[1]) < cdiv(numel, chunk_size):
        raise ValueError(f"{numel} elements need {cdiv(max(numel, 0), chunk_size)} chunks of {chunk_size} per row: "
                         f"got rows of {q.shape[1]} codes, {mins.shape[1]} mins and {maxs.shape[1]} maxs")
    check_result(dtype, out, numel, (q, mins, maxs))
    return k


def check_result(dtype: torch.dtype, out: torch.Tensor | None, numel: int, inputs: tuple[torch.Tensor, ...]) -> None:
    """The result of the decode-and-sum ops: a float ``dtype``, and ``out`` when given (contiguous, ``numel`` elements
    of ``dtype``, on the inputs' device, over none of their bytes), which every backend writes in place."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if out is None:
        return
    device = inputs[0].device
    if out.dtype != dtype or out.device != device or out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {numel} elements on {device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}"
                         + ("" if out.is_contiguous() else ", not contiguous"))
    check_disjoint((out,), inputs)


def dequantize_minmax_reduce(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                             *, factor: float = 1.0, dtype: torch.dtype = torch.float32,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    k = check_minmax_rows(q, mins, maxs, chunk_size, numel, dtype, out)
    nchunks = cdiv(numel, chunk_size)
    params = [minmax_params(mins[a, :nchunks], maxs[a, :nchunks]) for a in range(k)]
    given, out = out, (torch.empty(numel, dtype=dtype, device=q.device) if out is None else out.view(-1))
    d = None
    for start, stop, rows, c in _row_blocks(numel, chunk_size):   # a block of every row, summed in cache
        dst = out[start:stop].view(_block_shape(start, stop, rows, chunk_size))
        acc = dst if dtype == torch.float32 else torch.empty_like(dst, dtype=torch.float32)
        _decode_minmax_block(q[0, start:stop], *params[0], c, acc)   # row 0 starts the sum
        for a in range(1, k):
            d = torch.empty_like(acc) if d is None or d.shape != acc.shape else d
            _decode_minmax_block(q[a, start:stop], *params[a], c, d)
            acc.add_(d)
        acc.mul_(factor)   # fp32: the block times fl32(factor)
        if acc is not dst:
            dst.copy_(acc)
    return out if given is None else given


def check_minmax_rows_args(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int,
                           out: torch.Tensor) -> tuple[int, int]:
    """Validate ``dequantize_minmax_rows``'s arguments (every backend): ``R`` rows of codes, mins and maxs as
    :func:`check_minmax_rows` takes them and ``out`` ``[R, n]`` (rows contiguous, apart, clear of the inputs).
    Returns ``(R, n)``."""
    check_rows(q, "q")
    check_rows(out, "out")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out must be float32, float16 or bfloat16, got {out.dtype}")
    if out.device != q.device:
        raise ValueError(f"out must be on q's device {q.device}, got {out.device}")
    rows, n = out.shape
    if q.shape[0] != rows or mins.shape[0] != rows or maxs.shape[0] != rows:
        raise ValueError(f"q, mins, maxs and out must have the same rows; got {tuple(q.shape)}, {tuple(mins.shape)}, "
                         f"{tuple(maxs.shape)} and {tuple(out.shape)}")
    check_rows_apart(out, "out's")
    if rows:   # the codes and (min, max) pairs of each row, as the one-row decode takes them
        check_minmax_rows(q, mins, maxs, chunk_size, n)
    check_disjoint((out,), (q, mins, maxs))
    return rows, n


def dequantize_minmax_rows(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, *,
                           out: torch.Tensor) -> torch.Tensor:
    """One :func:`dequantize_minmax_reduce` call per row: a row's decode is the one-row decode-and-average with
    factor 1, bit for bit."""
    check_minmax_rows_args(q, mins, maxs, chunk_size, out)
    return minmax_rows_by_row(dequantize_minmax_reduce, q, mins, maxs, chunk_size, out)


def minmax_rows_by_row(reduce, q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int,
                       out: torch.Tensor) -> torch.Tensor:
    """The row decode as one ``reduce`` (a backend's one-row decode-and-average) call per row of ``out``, on
    arguments already checked by :func:`check_minmax_rows_args`."""
    for r in range(out.shape[0]):
        reduce(q[r:r + 1], mins[r:r + 1], maxs[r:r + 1], chunk_size, out.shape[1], dtype=out.dtype, out=out[r])
    return out
