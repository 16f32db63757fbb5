"""The ``qwz`` parameter all-gather: block-quantized INT8 weights (ZeRO++ qwZ, seed 000 section 3.1).

[Note: qwZ data flow]
Each rank block-quantizes its ``n``-element shard to INT8 codes with one fp32 scale per ``quant_group_size``
elements (``megatron_ext.kernels.quantize_symmetric``), packs codes and scales into one byte row, and all-gathers
the rows over the DP group in a single collective. Every rank, the owner of the shard included, then decodes all
``P`` rows with the same deterministic decode (``dequantize_rows``, reading the received buffer in place) into
``out_bucket``: the weights are bit-identical on all ranks, while the fp32 master shards held by the optimizer stay
exact (the owner's exact shard is overwritten in the *model* buffer only).

Groups are balanced: the shard is cut into ``G = ceil(n / quant_group_size)`` groups of ``g = ceil(n / G)``
elements (at most ``quant_group_size``), so padding is under ``G`` elements instead of up to a whole group.
Row layout (bytes): ``[codes (G*g, padded to a multiple of 4) | G fp32 scales]``. Bytes sent per rank (pairwise
model of the ledger): ``row * (P - 1)``, split ``row * (r - 1)`` intra-node and ``row * (P - r)`` inter-node, with
``row = round_up(G * g, 4) + 4 * G`` (:func:`qwz_row_bytes`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import ParamGather, TorchWork, Work, register_param_gather
from .wire import empty_rows, row_bytes, unpack_rows

QWZ_BITS = 8


def qwz_group(n: int, group_size: int) -> int:
    """Balanced group length for an ``n``-element shard (see the module note)."""
    groups = max(1, -(-n // group_size))
    return max(1, -(-n // groups))


def gather_group(n: int, group_size: int, bits: int) -> int:
    """Group length of a quantized all-gather of ``n`` elements (even for INT4: two codes per byte)."""
    g = qwz_group(n, group_size)
    return g + (g % 2) if bits == 4 else g


def qwz_row_bytes(n: int, group_size: int, bits: int = QWZ_BITS) -> int:
    """Bytes one rank contributes to a quantized all-gather (qwZ: INT8) of an ``n``-element shard."""
    g = gather_group(n, group_size, bits)
    groups = -(-n // g)
    return row_bytes(groups * g * bits // 8, groups)


@register_param_gather("qwz")
class QwzParamGather(ParamGather):
    """INT8 block-quantized all-gather; see the module note."""

    def all_gather(self, shard: torch.Tensor, out_bucket: torch.Tensor) -> Work:
        return quantized_all_gather(self.topology, self.ledger, shard, out_bucket, QWZ_BITS,
                                    self.options.quant_group_size, "qwz_all_gather")


def quantized_all_gather(topo, ledger, shard: torch.Tensor, out_bucket: torch.Tensor, bits: int, group_size: int,
                         name: str) -> Work:
    """Block-quantize ``shard`` (``bits`` 4 or 8), all-gather codes and scales in one collective, and decode every
    rank's row -- the owner's too -- into ``out_bucket``: identical values on every rank (see the module note)."""
    from megatron_ext.kernels import dequantize_rows, quantize_symmetric
    from megatron_ext.kernels.layout import codes_dtype

    from .plain import local_gather

    done = local_gather(topo, shard, out_bucket)
    if done is not None:
        return done
    n = shard.numel()
    group = gather_group(n, group_size, bits)
    num_scales = -(-n // group)
    cb = num_scales * group * bits // 8
    # quantized straight into the row this rank sends
    row, codes, scales = empty_rows(1, cb, num_scales, codes_dtype(bits), shard.device)
    quantize_symmetric(shard.contiguous(), bits=bits, group_size=group, out=(codes, scales))
    row = row.view(-1)
    recv = torch.empty(topo.size * row.numel(), dtype=torch.uint8, device=row.device)
    intra, inter = topo.peers()
    ledger.record_pairwise(name, row.numel(), intra, inter)
    handle = _all_gather(recv, row, group=topo.group, async_op=True)
    P = topo.size

    def epilogue() -> None:
        # One decode of all P rows (per-bucket overhead: one kernel, not P), read where they lie in the received
        # buffer and written straight into the bucket; a row holds whole groups, so every element decodes as a
        # per-row decode would.
        all_codes, all_scales = unpack_rows(recv, P, cb, codes.dtype, num_scales)
        dequantize_rows(all_codes, all_scales, bits=bits, group_size=group, out=out_bucket.view(P, n))

    return TorchWork(handle, epilogue)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """torch >= 2.13 renames all_gather_into_tensor to all_gather_single."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)
