"""Quantization kernels for the quantized communication backends (qwZ, qgZ, ByteGrad).

Every op has a torch reference (:mod:`.reference`, the specification, run eager), the same math compiled into fused
CPU loops by ``torch.compile`` (:mod:`.compiled`, the default CPU path) and a Triton kernel (:mod:`.triton_symmetric`,
:mod:`.triton_minmax`, the CUDA path); on AVX-512 and AVX2 CPUs the compiled path hands the INT4 intra-node qgZ
reduction and the fp32 codecs to hand-written C (:mod:`.native`); all give the same bits, and :mod:`.backend`
chooses one per call. Layouts and padded sizes are documented in :mod:`.layout` ([Note: qgZ swizzle layout]).

Codes: INT8 codes are ``torch.int8``; INT4 codes are ``torch.uint8`` bytes with two signed nibbles, the even element
in bits 4-7. Scales are fp32, one per ``group_size`` elements: ``scale = absmax / (2^(b-1) - 1)``, 0 for an all-zero
group, so the largest element gets the code +-(2^(b-1) - 1) and is never clipped (DeepSpeed's ``absmax / 2^(b-1)``
clips it by a whole step); it dequantizes to ``fl(fl(absmax / qmax) * qmax)``, which is absmax or one of its fp32
neighbours (not always absmax itself: 63.5625 at INT8 comes back as 63.562504). Codes are padded to whole groups;
the last group is zero-padded.
"""
from __future__ import annotations

import torch

from . import reference as _ref
from .backend import BACKENDS, select_backend, triton_available, use_backend
from .layout import SwizzleLayout, codes_dtype, num_groups, swizzle_layout, swizzle_permutation

__all__ = [
    "quantize_symmetric", "dequantize_symmetric", "quantize_minmax_uint8", "dequantize_minmax_uint8",
    "dequantize_minmax_reduce", "dequantize_minmax_rows",
    "dequantize_rows", "swizzle_quantize", "dequantize_reduce_quantize", "dequantize_reduce",
    "SwizzleLayout", "swizzle_layout", "swizzle_permutation", "num_groups", "codes_dtype",
    "use_backend", "select_backend", "triton_available", "BACKENDS",
]


def _impl(device_type: str):
    backend = select_backend(device_type)
    if backend == "triton":
        from . import triton_ops
        return triton_ops
    if backend == "compiled":
        from . import compiled
        return compiled
    return _ref


def quantize_symmetric(x: torch.Tensor, *, bits: int, group_size: int,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric INT8/INT4 quantization of the flattened ``x`` (fp32/fp16/bf16, contiguous).

    Returns ``(codes, scales)``: ``codes`` 1-D, ``ceil(numel/group_size) * group_size * bits/8`` bytes (int8 for 8 bit,
    packed uint8 for 4 bit); ``scales`` 1-D fp32, one per group. Small groups keep outliers from flattening every
    other value to zero (seed 000 Fig. 2).

    ``out=(codes [R, bytes/R], scales [R, groups/R])``: the same bytes written into ``R`` rows instead (equal parts
    of whole groups; each row contiguous, rows at any stride), and ``out`` returned. This is how a backend writes the
    ``[codes | scales]`` rows it sends (:mod:`megatron_ext.comm.wire`): in place on CUDA, by a copy elsewhere.
    An ``out`` whose memory meets the input's is refused (every backend; so is ``dequantize_rows``'s).
    """
    return _impl(x.device.type).quantize_symmetric(x, bits=bits, group_size=group_size, out=out)


def dequantize_symmetric(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int, numel: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_symmetric`: 1-D ``numel`` elements of ``dtype``, ``fl32(code * scale)`` rounded."""
    return _impl(codes.device.type).dequantize_symmetric(codes, scales, bits=bits, group_size=group_size,
                                                          numel=numel, dtype=dtype)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Dequantize each row of ``codes`` ([R, bytes], whole groups) with its row of ``scales`` ([R, groups] fp32)
    into ``out`` ([R, n] of fp32/fp16/bf16, ``n <= groups * group_size``: a row's padding is dropped); returns
    ``out``. Each tensor's rows are contiguous, at any row stride: a gathered ``[codes | scales]`` byte buffer is
    decoded where it lies, straight into the destination (on CUDA one kernel, no copy; qwZ's all-gather)."""
    return _impl(codes.device.type).dequantize_rows(codes, scales, bits=bits, group_size=group_size, out=out)


def quantize_minmax_uint8(x: torch.Tensor, chunk_size: int, *,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ByteGrad min-max UINT8 quantization, one (min, max) per ``chunk_size`` elements.

    Returns ``(q, mins, maxs)``: ``q`` uint8 with ``numel`` codes (no padding), ``mins``/``maxs`` fp32, one per chunk
    (over the real elements only). ``scale = 255/(max-min+1e-7)``, ``ub = rint(max*scale)``, ``lb = ub-255``,
    ``q = min(rint(x*scale), ub) - lb`` (clamped to [0, 255] against fp32 rounding), all in fp32.

    Overflow (ByteGrad's convention, kept): a chunk where ``max*scale`` overflows fp32 -- in practice a constant chunk
    with ``|x| > FLT_MAX / 2.55e9 ~ 1.33e29`` (the 1e-7 makes ``scale = 2.55e9``) -- has ``lb = +-inf``; its codes are
    0 and it dequantizes to ``+-inf`` (the sign of ``max``): the overflow stays visible (an fp16 run's loss scaler
    skips the step; the gradient norm becomes inf) instead of turning into a silently wrong finite value.

    ``out=(q [R, n], mins [R, ceil(n / chunk_size)], maxs [R, ceil(n / chunk_size)])``: the same values written into
    ``R`` rows of whole chunks instead (each row contiguous, rows at any stride; a single row may end in a partial
    chunk), and ``out`` returned: ByteGrad's ``[q | pad | mins | maxs]`` rows, in place on CUDA, by a copy elsewhere.
    """
    return _impl(x.device.type).quantize_minmax_uint8(x, chunk_size, out=out)


def dequantize_minmax_uint8(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_minmax_uint8`: ``(q + lb) / scale`` in fp32, cast to ``dtype``."""
    return _impl(q.device.type).dequantize_minmax_uint8(q, mins, maxs, chunk_size, numel, dtype)


def dequantize_minmax_reduce(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, numel: int,
                             *, factor: float = 1.0, dtype: torch.dtype = torch.float32,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """ByteGrad's decode-and-average in one pass: the ``k`` min-max rows decoded as :func:`dequantize_minmax_uint8`
    does, summed in fp32 in row order (``(d_0 + d_1) + d_2 ...``), times ``fl32(factor)``, cast to ``dtype``.

    ``q`` is ``[k, >= numel]`` uint8, ``mins``/``maxs`` ``[k, >= ceil(numel / chunk_size)]`` fp32; each row
    contiguous, the rows at any stride (the rows of a received ``[q | pad | mins | maxs]`` buffer, read in place).
    Returns ``numel`` elements: one kernel on CUDA instead of ``2k + 1`` (``2k`` for fp32: k decodes, k - 1 adds,
    the multiply and the cast), one pass over memory on CPU. ``out``: a contiguous ``dtype`` tensor of ``numel``
    elements to write them into (a slice of the bucket: no copy after), returned; refused where it meets an input.
    With one row this is the plain decode, :func:`dequantize_minmax_uint8`, for a row read in place.
    """
    return _impl(q.device.type).dequantize_minmax_reduce(q, mins, maxs, chunk_size, numel, factor=factor,
                                                          dtype=dtype, out=out)


def dequantize_minmax_rows(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, chunk_size: int, *,
                           out: torch.Tensor) -> torch.Tensor:
    """Decode each of ``R`` min-max rows into its row of ``out`` ([R, n] of fp32/fp16/bf16); returns ``out``. ``q``
    ([R, >= n] uint8), ``mins``/``maxs`` ([R, >= ceil(n / chunk_size)] fp32) and ``out`` have contiguous rows at any
    stride: ByteGrad's all-gathered ``[q | pad | mins | maxs]`` rows decoded where they lie, straight into the
    bucket (on CUDA one kernel for all rows instead of one per row). Row ``r`` gets the bits of
    :func:`dequantize_minmax_uint8` on that row."""
    return _impl(q.device.type).dequantize_minmax_rows(q, mins, maxs, chunk_size, out=out)


def swizzle_quantize(x: torch.Tensor, bits: int, group_size: int, nodes: int, ranks_per_node: int,
                     pipeline_stages: int = 1, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """qgZ tensor-slice reordering fused with symmetric quantization (seed 000 eq. 1-2, Algorithm 2).

    Returns ``codes [S, W, chunk_bytes]`` and ``scales [S, W, chunk_groups]`` (fp32) where ``codes[s, b*N + a]`` is
    stage chunk ``s`` of partition ``a*D + b``; sizes from :func:`swizzle_layout`. See [Note: qgZ swizzle layout] in
    :mod:`.layout` for how the qgZ backend splits and sends it. ``out``: rows, as in :func:`quantize_symmetric`.
    """
    return _impl(x.device.type).swizzle_quantize(x, bits, group_size, nodes, ranks_per_node, pipeline_stages, out)


def dequantize_reduce_quantize(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, *,
                               out: tuple[torch.Tensor, torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused intra-node qgZ step: dequantize ``k`` received chunks, sum in fp32, requantize.

    ``chunks`` is ``[k, nbytes]`` (codes of equal-length chunks, whole groups), ``scales`` ``[k, groups]`` fp32;
    each row contiguous, the rows at any stride (the rows of a received buffer, read in place on CUDA).
    Returns ``(codes [nbytes], scales [groups])`` of the sum; one pass over memory instead of three (seed 000 4.2).
    ``out``: rows, as in :func:`quantize_symmetric`.
    """
    return _impl(chunks.device.type).dequantize_reduce_quantize(chunks, scales, bits, group_size, out)


def dequantize_reduce(chunks: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
                      numel: int | None = None, dtype: torch.dtype = torch.float32, factor: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Final qgZ step: dequantize ``k`` chunks (``[k, nbytes]``, scales ``[k, groups]``, rows as in
    :func:`dequantize_reduce_quantize`) and sum them in fp32.

    Returns the first ``numel`` (default: all ``groups * group_size``) elements of the sum times ``fl32(factor)``
    (qgZ's averaging, in the same pass), cast to ``dtype``; written into ``out`` (contiguous, ``numel`` elements of
    ``dtype``, disjoint from the inputs: a gradient shard) when given.
    """
    return _impl(chunks.device.type).dequantize_reduce(chunks, scales, bits=bits, group_size=group_size,
                                                       numel=numel, dtype=dtype, factor=factor, out=out)
