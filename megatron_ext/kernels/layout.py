"""Shapes, padding and slice orders shared by the torch and Triton kernels.

Everything the caller needs to know about padded sizes lives here, so that the two backends (and the qgZ backend that
consumes their output) compute them in exactly one way.

[Note: qgZ swizzle layout]
A qgZ bucket of ``L`` elements is split into ``W = nodes * ranks_per_node`` equal *partitions* of
``n = ceil(L / W)`` elements (the input is treated as zero-padded to ``W * n``); rank ``r`` must end with partition
``r`` of the sum. With ``S = pipeline_stages``, every partition is cut into ``S`` contiguous *stage chunks* of
``m = ceil(n / S)`` elements (the last ones zero-padded), and every stage chunk is zero-padded to
``chunk_numel = ceil(m / group_size) * group_size`` so that no scale group straddles a chunk.

``swizzle_quantize`` returns ``codes`` of shape ``[S, W, chunk_bytes]`` and ``scales`` of shape
``[S, W, chunk_groups]``: ``codes[s, j]`` holds stage chunk ``s`` of partition ``p = (j % N) * D + j // N``
(``N`` nodes, ``D`` ranks per node), i.e. partition ``p = a * D + b`` (node ``a``, local rank ``b``) sits in slot
``j = b * N + a`` -- seed 000 eq. 1-2, ``x.view(N, D, -1).transpose(0, 1)``; 2 nodes x 4 ranks gives the slot order
``[0, 4, 1, 5, 2, 6, 3, 7]``. Stage ``s`` is the contiguous block ``codes[s]`` so that each pipeline stage is an
independent 2-hop all-to-all (seed 000 Algorithm 2: finer slices, one reorder per stage). In terms of the
``W * S`` equal input slices (slice ``i = p * S + s``), output slot ``s * W + b * N + a`` holds slice
``(a * D + b) * S + s``; :func:`swizzle_permutation` returns that list.

Consumer (qgZ), per stage ``s``, on global rank ``r = a * D + b``:
  1. intra-node all_to_all: ``codes[s].view(D, N * chunk_bytes)`` row ``b'`` goes to local peer ``b'`` (same for the
     scales, ``view(D, N * chunk_groups)``); receive ``[D, N * chunk_bytes]`` from the D local peers;
  2. ``dequantize_reduce_quantize(recv_codes, recv_scales, bits, group_size)`` -> ``N * chunk_numel`` requantized
     elements: stage chunk ``s`` of partitions ``a' * D + b`` for ``a' = 0..N-1``, summed over the node;
  3. inter-node all_to_all among the ranks with local index ``b``: ``codes.view(N, chunk_bytes)`` row ``a'`` goes to
     node ``a'``; receive ``[N, chunk_bytes]``;
  4. ``dequantize_reduce(recv_codes, recv_scales, bits=..., group_size=..., numel=chunk_numel)`` is stage chunk ``s``
     of partition ``r`` summed over all ranks; its first ``stage_valid_numel(s)`` elements are
     ``partition[s * m : s * m + stage_valid_numel(s)]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def qmax(bits: int) -> int:
    """Largest code magnitude: 127 for INT8, 7 for INT4 (-2^(b-1) is never produced, so the range is symmetric)."""
    return (1 << (bits - 1)) - 1


def check_bits_group(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"INT4 packs two codes per byte: group_size must be even, got {group_size}")


def check_contiguous(t: torch.Tensor, name: str) -> None:
    """Every kernel reads flat memory: a strided view would silently be read as the wrong elements."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
            "the kernels read flat memory and would silently use the wrong elements: call .contiguous() first")


def check_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    check_contiguous(x, name)


def check_rows(t: torch.Tensor, name: str) -> None:
    """A 2-D tensor whose rows are each contiguous, at any row stride (e.g. rows of a received byte buffer)."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with contiguous rows (got shape {tuple(t.shape)}, strides "
                         f"{tuple(t.stride())})")


def check_rows_apart(t: torch.Tensor, owner: str) -> None:
    """An output's rows may not overlap one another (``owner``: the possessive that names them, e.g. ``"out's"``)."""
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(f"{owner} rows overlap (row stride {t.stride(0)} < row length {t.shape[1]})")


def check_codes(codes: torch.Tensor, bits: int, name: str = "codes", rows: bool = False) -> None:
    """Codes of ``bits``: flat memory, or with ``rows`` a 2-D tensor of contiguous rows (:func:`check_rows`)."""
    want = torch.int8 if bits == 8 else torch.uint8
    if codes.dtype != want:
        raise TypeError(f"{name} for {bits}-bit codes must be {want}, got {codes.dtype}")
    if rows:
        check_rows(codes, name)
    else:
        check_contiguous(codes, name)


def check_minmax_codes(q: torch.Tensor, name: str = "q") -> None:
    if q.dtype != torch.uint8:
        raise TypeError(f"{name} (min-max codes) must be torch.uint8, got {q.dtype}")
    check_contiguous(q, name)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of memory ``t`` can touch (its strides' bounding span; empty for no elements)."""
    n = t.numel()
    if n == 0:
        return 0, 0
    first = t.data_ptr()
    if t.is_contiguous():   # the common case, without the Python loop (this runs on every call of the ops)
        return first, first + n * t.element_size()
    last = 0
    for size, stride in zip(t.shape, t.stride()):
        last += (size - 1) * stride
    return first, first + (last + 1) * t.element_size()


def check_disjoint(outs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], name: str = "out") -> None:
    """Refuse outputs whose memory span meets an input's: the kernels write one group's result while other programs
    (or later blocks) still read the input, so an aliased ``out`` would silently corrupt both."""
    spans = [(t.device, _byte_span(t)) for t in inputs]
    for o in outs:
        a0, a1 = _byte_span(o)
        for device, (b0, b1) in spans:
            if a0 < b1 and b0 < a1 and o.device == device:
                raise ValueError(f"{name} overlaps the op's input (bytes [{a0:#x}, {a1:#x}) and [{b0:#x}, {b1:#x})): "
                                 "the result cannot be written over what the op reads; pass separate memory")


# Triton kernels index with int32 (program ids, aranges and the offsets built from them): an offset >= 2^31 would
# wrap around silently and read or write the wrong memory. Every Triton launcher checks its extent first.
INT32_OFFSET_LIMIT = 1 << 31


def check_int32_offsets(extent: int, what: str) -> None:
    """Raise unless every offset below ``extent`` (one past the largest a kernel forms) fits in int32."""
    if extent > INT32_OFFSET_LIMIT:
        raise ValueError(
            f"{what} needs offsets up to {extent - 1}, beyond the Triton kernels' int32 indexing (max "
            f"{INT32_OFFSET_LIMIT - 1}): use smaller buckets (--ddp-bucket-size) or the torch backend "
            "(MX_KERNELS=torch)")


def codes_dtype(bits: int) -> torch.dtype:
    """INT8 codes are int8; INT4 codes are uint8 bytes holding two signed nibbles (even element high)."""
    return torch.int8 if bits == 8 else torch.uint8


def num_groups(numel: int, group_size: int) -> int:
    return cdiv(numel, group_size)


def code_bytes(numel_padded: int, bits: int) -> int:
    return numel_padded * bits // 8


@dataclass(frozen=True)
class SwizzleLayout:
    """Padded sizes of a qgZ swizzle (see [Note: qgZ swizzle layout] in this module)."""

    numel: int  # L, the caller's element count
    nodes: int  # N
    ranks_per_node: int  # D
    stages: int  # S
    bits: int
    group_size: int
    partition_numel: int  # n = ceil(L / W)
    stage_numel: int  # m = ceil(n / S)
    chunk_numel: int  # m padded to a multiple of group_size

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def chunk_groups(self) -> int:
        return self.chunk_numel // self.group_size

    @property
    def chunk_bytes(self) -> int:
        return code_bytes(self.chunk_numel, self.bits)

    @property
    def codes_shape(self) -> tuple[int, int, int]:
        return (self.stages, self.world, self.chunk_bytes)

    @property
    def scales_shape(self) -> tuple[int, int, int]:
        return (self.stages, self.world, self.chunk_groups)

    @property
    def total_groups(self) -> int:
        return self.stages * self.world * self.chunk_groups

    @property
    def total_code_bytes(self) -> int:
        return self.stages * self.world * self.chunk_bytes

    def stage_valid_numel(self, stage: int) -> int:
        """Real (unpadded) elements of stage chunk ``stage`` in every partition."""
        return max(0, min(self.stage_numel, self.partition_numel - stage * self.stage_numel))


def swizzle_layout(numel: int, bits: int, group_size: int, nodes: int, ranks_per_node: int,
                   pipeline_stages: int = 1) -> SwizzleLayout:
    """Padded sizes of ``swizzle_quantize`` for a bucket of ``numel`` elements."""
    check_bits_group(bits, group_size)
    if nodes < 1 or ranks_per_node < 1 or pipeline_stages < 1:
        raise ValueError(f"nodes ({nodes}), ranks_per_node ({ranks_per_node}) and pipeline_stages "
                         f"({pipeline_stages}) must be >= 1")
    world = nodes * ranks_per_node
    n = cdiv(numel, world)
    m = cdiv(n, pipeline_stages)
    chunk = max(1, cdiv(m, group_size)) * group_size
    return SwizzleLayout(numel=numel, nodes=nodes, ranks_per_node=ranks_per_node, stages=pipeline_stages,
                         bits=bits, group_size=group_size, partition_numel=n, stage_numel=m, chunk_numel=chunk)


def swizzle_permutation(nodes: int, ranks_per_node: int, pipeline_stages: int = 1) -> list[int]:
    """``perm[k]`` = index of the input slice (of ``W * S`` equal slices) stored in output slot ``k``.

    Output slot ``k = s * W + b * N + a`` holds stage ``s`` of partition ``a * D + b``, i.e. input slice
    ``(a * D + b) * S + s``. For one stage this is seed 000 eq. 2: ``[0, D, 2D, ..., 1, D + 1, ...]``.
    """
    n_, d_, s_ = nodes, ranks_per_node, pipeline_stages
    return [(a * d_ + b) * s_ + s for s in range(s_) for b in range(d_) for a in range(n_)]
