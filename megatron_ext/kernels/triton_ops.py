"""Host-side launchers of the Triton kernels, with the same signatures and outputs as :mod:`.reference`."""
from __future__ import annotations

import functools

import torch
import triton

from . import reference as _ref
from . import triton_minmax as _mm
from . import triton_symmetric as _sym
from .layout import (cdiv, check_bits_group, check_input, check_int32_offsets, codes_dtype,
                     num_groups, qmax, swizzle_layout)
from .triton_launch import FastLauncher

# FMA contraction would change fp32 rounding (x*scale + 2^23 in rint, acc + code*scale): keep it off so the GPU
# results equal the torch reference bit for bit. The interpreter ignores the option.
_OPTS = {"enable_fp_fusion": False}
_MINMAX_BLOCK = 2048
_MAX_GRID_ROWS = 65535  # CUDA's limit on grid axis 1 (dequantize_rows launches a block of rows at a time)
_FINISH_BLOCK = 1024  # partials reduced per step by the per-chunk finishing program
_swizzle_quantize = FastLauncher(_sym.swizzle_quantize_kernel)
_reduce = FastLauncher(_sym.reduce_kernel)
_partial_minmax = FastLauncher(_mm.partial_minmax_kernel)
_finish_minmax = FastLauncher(_mm.finish_minmax_kernel)
_minmax_quantize = FastLauncher(_mm.minmax_quantize_kernel)
_minmax_dequantize_reduce = FastLauncher(_mm.minmax_dequantize_reduce_kernel)


@functools.lru_cache(maxsize=None)
def _tile(bits: int, group_size: int) -> tuple[int, int]:
    """(COLS, GPP): columns of the per-group tile and groups per program (about 4K elements per program); cached,
    as it runs on every launch (5 us uncached)."""
    cols = triton.next_power_of_2(group_size if bits == 8 else group_size // 2)
    gpp = max(1, min(64, 4096 // cols))
    return cols, triton.next_power_of_2(gpp) if gpp & (gpp - 1) else gpp


def _tiled_extent(groups: int, bits: int, group_size: int) -> int:
    """One past the largest element offset the symmetric kernels form over ``groups`` groups, masked lanes of the
    last tile included (they run past the end by up to GPP - 1 groups and COLS columns)."""
    cols, gpp = _tile(bits, group_size)
    return cdiv(groups, gpp) * gpp * group_size + 2 * cols


def _row_layout(out: tuple[torch.Tensor, torch.Tensor] | None, bits: int, code_bytes: int, groups: int,
                inputs: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
    """(groups per row, code row stride, scale row stride) of a quantizing op's output: ``out``'s rows (checked), or
    one contiguous row."""
    if out is None:
        return max(groups, 1), code_bytes, groups
    _, gpr = _ref.check_out_rows(out, bits, code_bytes, groups, inputs)
    return gpr, out[0].stride(0), out[1].stride(0)


def _max_row_offset(last: int, gpr: int, stride: int, unit: int) -> int:
    """The largest ``(t // gpr) * stride + (t % gpr) * unit`` over groups ``t <= last``: at ``last`` or at the end of
    the row before it."""
    r = last // gpr
    top = r * stride + (last - r * gpr) * unit
    return max(top, (r - 1) * stride + (gpr - 1) * unit) if r else top


def _check_row_offsets(groups: int, bits: int, group_size: int, rows: tuple[int, int, int], what: str) -> None:
    """Every offset the kernels form for groups stored by rows (masked groups of the last tile included) fits; with
    one contiguous row these are the offsets of :func:`_tiled_extent`."""
    cols, gpp = _tile(bits, group_size)
    gpr, code_stride, scale_stride = rows
    last = cdiv(groups, gpp) * gpp - 1
    check_int32_offsets(_max_row_offset(last, gpr, code_stride, group_size * bits // 8) + 2 * cols, what)
    check_int32_offsets(_max_row_offset(last, gpr, scale_stride, 1) + 1, what)


def _launch_quantize(x: torch.Tensor, numel: int, part: int, stage: int, nodes: int, rpn: int, gpc: int,
                     total_groups: int, bits: int, group_size: int, codes: torch.Tensor, scales: torch.Tensor,
                     rows: tuple[int, int, int]):
    cols, gpp = _tile(bits, group_size)
    # unmasked source offsets p*part + s*stage + e stay below W*part plus one chunk (masked lanes never dereference
    # theirs); output offsets are tiled
    check_int32_offsets(max(_tiled_extent(total_groups, bits, group_size), nodes * rpn * part + gpc * group_size),
                        "quantize")
    _check_row_offsets(total_groups, bits, group_size, rows, "quantize")
    grid = (cdiv(total_groups, gpp),)
    _swizzle_quantize(grid, x, codes, scales, numel, part, stage, total_groups, gpc, *rows,
                      NODES=nodes, RPN=rpn, GROUP=group_size, COLS=cols, GPP=gpp, BITS=bits, QMAX=qmax(bits), **_OPTS)


def quantize_symmetric(x: torch.Tensor, *, bits: int, group_size: int,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_input(x)
    check_bits_group(bits, group_size)
    numel = x.numel()
    groups = num_groups(numel, group_size)
    nbytes = groups * group_size * bits // 8
    rows = _row_layout(out, bits, nbytes, groups, (x,))
    if out is None:
        codes = torch.empty(nbytes, dtype=codes_dtype(bits), device=x.device)
        scales = torch.empty(groups, dtype=torch.float32, device=x.device)
    else:
        codes, scales = out
    if groups:
        # one "chunk" holding every group: the swizzle kernel degenerates to a plain quantizer
        _launch_quantize(x, numel, numel, numel, 1, 1, groups, groups, bits, group_size, codes, scales, rows)
    return codes, scales


def swizzle_quantize(x: torch.Tensor, bits: int, group_size: int, nodes: int, ranks_per_node: int,
                     pipeline_stages: int = 1, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    check_input(x)
    lay = swizzle_layout(x.numel(), bits, group_size, nodes, ranks_per_node, pipeline_stages)
    total = lay.total_groups
    rows = _row_layout(out, bits, lay.total_code_bytes, total, (x,))
    if out is None:
        codes = torch.empty(lay.codes_shape, dtype=codes_dtype(bits), device=x.device)
        scales = torch.empty(lay.scales_shape, dtype=torch.float32, device=x.device)
    else:
        codes, scales = out
    _launch_quantize(x, lay.numel, lay.partition_numel, lay.stage_numel, nodes, ranks_per_node, lay.chunk_groups,
                     total, bits, group_size, codes, scales, rows)
    return codes, scales


def _launch_reduce(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                   out: torch.Tensor | None, out_codes: torch.Tensor | None, out_scales: torch.Tensor | None,
                   rows: int = 1, row_strides: tuple[int, int, int] = (0, 0, 0),
                   out_rows: tuple[int, int, int] | None = None, k: int | None = None, factor: float = 1.0):
    """``chunks`` [k, bytes] and ``scales`` [k, groups], each row contiguous and the rows at any stride (chunks
    read in place from a received buffer). ``rows`` > 1: as many independent problems (grid axis 1), problem ``r``
    reading and writing ``r * row_strides`` (codes, scales, ``out``) further on. Requantizing (``out`` None):
    ``out_rows`` = (groups per row, code row stride, scale row stride) of ``out_codes`` / ``out_scales``. ``k``:
    the chunks reduced, when fewer than ``chunks`` has rows (the row decode's problems start at its first row).
    ``factor``: the stored sum is times ``fl32(factor)`` (not requantizing)."""
    k, groups = chunks.shape[0] if k is None else k, scales.shape[1]
    cols, gpp = _tile(bits, group_size)
    # chunk i at i * stride(0); masked lanes of the last tile run past its end (_tiled_extent)
    check_int32_offsets((rows - 1) * row_strides[0] + (k - 1) * chunks.stride(0)
                        + _tiled_extent(groups, bits, group_size), "dequantize/reduce")
    check_int32_offsets((rows - 1) * row_strides[1] + (k - 1) * scales.stride(0) + groups, "dequantize/reduce")
    check_int32_offsets((rows - 1) * row_strides[2] + numel, "dequantize/reduce")
    requant = out is None
    if requant:
        _check_row_offsets(groups, bits, group_size, out_rows, "dequantize/reduce")
    dummy = out if out is not None else out_scales
    grid = (cdiv(groups, gpp), rows)
    _reduce(grid, chunks, scales, dummy, out_codes if requant else dummy, out_scales if requant else dummy, groups,
            numel, float(factor), chunks.stride(0), scales.stride(0), *row_strides, *(out_rows or (1, 0, 0)), K=k,
            GROUP=group_size, COLS=cols, GPP=gpp, BITS=bits, QMAX=qmax(bits), REQUANT=requant, **_OPTS)


def dequantize_symmetric(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int, numel: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    groups = _ref.check_dequantize_args(codes, scales, bits, group_size, numel)
    nbytes = groups * group_size * bits // 8
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if groups:
        sc = scales.reshape(-1)[:groups].float().contiguous().view(1, groups)
        _launch_reduce(codes.view(-1)[:nbytes].view(1, nbytes), sc, bits, group_size, numel, out, None, None)
    return out


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
                    out: torch.Tensor) -> torch.Tensor:
    rows, _, n = _ref.check_rows_args(codes, scales, bits, group_size, out)
    strides = (codes.stride(0), scales.stride(0), out.stride(0))
    if n and 0 < rows <= _MAX_GRID_ROWS:   # one launch: the problems are the rows, read and written where they lie
        _launch_reduce(codes, scales, bits, group_size, n, out, None, None, rows=rows, row_strides=strides, k=1)
        return out
    for r0 in range(0, rows if n else 0, _MAX_GRID_ROWS):
        r1 = min(rows, r0 + _MAX_GRID_ROWS)
        _launch_reduce(codes[r0:r0 + 1], scales[r0:r0 + 1], bits, group_size, n, out[r0:r1], None, None,
                       rows=r1 - r0, row_strides=strides, k=1)
    return out


def dequantize_reduce_quantize(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                               out: tuple[torch.Tensor, torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    _, groups = _ref.check_chunks(chunks, scales, bits, group_size)
    out_rows = _row_layout(out, bits, chunks.shape[1], groups, (chunks, scales))
    if out is None:
        codes = torch.empty(chunks.shape[1], dtype=chunks.dtype, device=chunks.device)
        out_scales = torch.empty(groups, dtype=torch.float32, device=chunks.device)
    else:
        codes, out_scales = out
    if groups:
        _launch_reduce(chunks, scales, bits, group_size, groups * group_size, None, codes, out_scales,
                       out_rows=out_rows)
    return codes, out_scales


def dequantize_reduce(chunks: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
                      numel: int | None = None, dtype: torch.dtype = torch.float32, factor: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    _, groups, numel = _ref.check_reduce_args(chunks, scales, bits, group_size, numel, dtype, out)
    given, out = out, (torch.empty(numel, dtype=dtype, device=chunks.device) if out is None else out.view(-1))
    if numel:
        _launch_reduce(chunks, scales, bits, group_size, numel, out, None, None, factor=factor)
    return out if given is None else given


def _minmax_grid(numel: int, chunk_size: int) -> tuple[int, int]:
    """(chunks, blocks per chunk); checks that the offsets c*chunk_size + blk*BLOCK + i fit in int32."""
    nchunks, nblk = cdiv(numel, chunk_size), cdiv(min(chunk_size, max(numel, 1)), _MINMAX_BLOCK)
    check_int32_offsets(max(nchunks - 1, 0) * chunk_size + nblk * _MINMAX_BLOCK, "min-max quantization")
    return nchunks, nblk


def quantize_minmax_uint8(x: torch.Tensor, chunk_size: int,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_input(x)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    numel = x.numel()
    nchunks, nblk = _minmax_grid(numel, chunk_size)
    if out is None:
        q = torch.empty(numel, dtype=torch.uint8, device=x.device)
        mins, maxs, scale, lb = torch.empty(4, nchunks, dtype=torch.float32, device=x.device).unbind()
        cpr, strides = max(nchunks, 1), (0, 0, 0)
    else:
        rows, n, cpr = _ref.check_minmax_out_rows(out, x, chunk_size)
        q, mins, maxs = out
        strides = (q.stride(0), mins.stride(0), maxs.stride(0))
        last = rows - 1
        check_int32_offsets(max(last * strides[0] + n + _MINMAX_BLOCK, last * strides[1] + cpr,
                                last * strides[2] + cpr), "min-max quantization into rows")
        scale, lb = torch.empty(2, nchunks, dtype=torch.float32, device=x.device).unbind()
    if nchunks == 0:
        return q, mins, maxs
    pmin = torch.empty(nchunks, nblk, dtype=torch.float32, device=x.device)
    pmax = torch.empty_like(pmin)
    _partial_minmax((nchunks * nblk,), x, pmin, pmax, numel, chunk_size, nblk, BLOCK=_MINMAX_BLOCK)
    _finish_minmax((nchunks,), pmin, pmax, mins, maxs, scale, lb, nblk, max(cpr, 1), strides[1], strides[2],
                   BLOCK=_FINISH_BLOCK, **_OPTS)
    _minmax_quantize((nchunks * nblk,), x, q, scale, lb, numel, chunk_size, nblk, max(cpr, 1), strides[0],
                     BLOCK=_MINMAX_BLOCK, **_OPTS)
    return q, mins, maxs


def _minmax_decode_grid(numel: int, chunk_size: int, k: int, strides: tuple[int, int, int]) -> tuple[int, int]:
    """(chunks, blocks per chunk) of the min-max decode kernel, after checking the int32 offsets it forms within a
    problem: the ``k`` summed rows at ``strides`` (row strides of q, mins, maxs) and the chunk offsets. A row decode's
    problems sit further on by an int64 offset (grid axis 1), which needs no check."""
    nchunks, nblk = _minmax_grid(numel, chunk_size)
    last = k - 1
    check_int32_offsets(max(last * strides[0] + max(nchunks - 1, 0) * chunk_size + nblk * _MINMAX_BLOCK,
                            last * strides[1] + nchunks, last * strides[2] + nchunks), "min-max decode")
    return nchunks, nblk


def _launch_minmax_decode(grid: tuple[int, int], q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor,
                          chunk_size: int, numel: int, out: torch.Tensor, k: int, factor: float, rows: int = 1,
                          strides: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
    """The min-max decode kernel over ``k`` rows summed (``rows`` 1) or ``rows`` independent one-row problems (``k``
    1); ``grid`` from :func:`_minmax_decode_grid`; ``strides`` = row strides of q, mins, maxs and out (a 1-D input
    passes 0)."""
    nchunks, nblk = grid
    if nchunks and rows:
        _minmax_dequantize_reduce((nchunks * nblk, rows), q, strides[0], mins, strides[1], maxs, strides[2], out,
                                  strides[3], numel, chunk_size, nblk, k, float(factor), BLOCK=_MINMAX_BLOCK, **_OPTS)


def dequantize_minmax_uint8(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _ref.check_minmax_dequantize_args(q, mins, maxs, chunk_size, numel)
    grid = _minmax_decode_grid(numel, chunk_size, 1, (0, 0, 0))
    out = torch.empty(numel, dtype=dtype, device=q.device)
    _launch_minmax_decode(grid, q, mins.float().contiguous(), maxs.float().contiguous(), chunk_size, numel, out, 1,
                          1.0)
    return out


def dequantize_minmax_reduce(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                             *, factor: float = 1.0, dtype: torch.dtype = torch.float32,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    k = _ref.check_minmax_rows(q, mins, maxs, chunk_size, numel, dtype, out)
    strides = (q.stride(0), mins.stride(0), maxs.stride(0))
    grid = _minmax_decode_grid(numel, chunk_size, k, strides)
    given, out = out, (torch.empty(numel, dtype=dtype, device=q.device) if out is None else out.view(-1))
    _launch_minmax_decode(grid, q, mins, maxs, chunk_size, numel, out, k, factor, strides=(*strides, 0))
    return out if given is None else given


def dequantize_minmax_rows(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, *,
                           out: torch.Tensor) -> torch.Tensor:
    rows, n = _ref.check_minmax_rows_args(q, mins, maxs, chunk_size, out)
    grid = _minmax_decode_grid(n, chunk_size, 1, (0, 0, 0))   # rows lie any distance apart (int64 row offsets)
    strides = (q.stride(0), mins.stride(0), maxs.stride(0), out.stride(0))
    if rows <= _MAX_GRID_ROWS:   # one launch, each row read and written where it lies
        _launch_minmax_decode(grid, q, mins, maxs, chunk_size, n, out, 1, 1.0, rows=rows, strides=strides)
        return out
    for r0 in range(0, rows, _MAX_GRID_ROWS):
        r1 = min(rows, r0 + _MAX_GRID_ROWS)
        _launch_minmax_decode(grid, q[r0:r1], mins[r0:r1], maxs[r0:r1], chunk_size, n, out[r0:r1], 1, 1.0,
                              rows=r1 - r0, strides=strides)
    return out
