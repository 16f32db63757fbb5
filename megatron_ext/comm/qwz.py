"""The ``qwz`` parameter all-gather: block-quantized INT8 weights (ZeRO++ qwZ, seed 000 section 3.1).

[Note: qwZ data flow]
Each rank block-quantizes its ``n``-element shard to INT8 codes with one fp32 scale per ``quant_group_size``
elements (``megatron_ext.kernels.quantize_symmetric``), packs codes and scales into one byte row, and all-gathers
the rows over the DP group in a single collective. Every rank, the owner of the shard included, then decodes all
``P`` rows with the same deterministic ``dequantize_symmetric`` into ``out_bucket``: the weights are bit-identical
on all ranks, while the fp32 master shards held by the optimizer stay exact (the owner's exact shard is
overwritten in the *model* buffer only).

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

QWZ_BITS = 8


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


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
    return _round_up(groups * g * bits // 8, 4) + 4 * groups


def pack_codes_scales(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One uint8 row ``[codes | pad to 4 bytes | fp32 scales]`` (what qwZ puts on the wire per rank)."""
    cb = codes.numel() * codes.element_size()
    cb_pad = _round_up(cb, 4)
    sb = scales.numel() * 4
    row = torch.zeros(cb_pad + sb, dtype=torch.uint8, device=codes.device)
    row[:cb].copy_(codes.reshape(-1).view(torch.uint8))
    row[cb_pad:].copy_(scales.reshape(-1).to(torch.float32).view(torch.uint8))
    return row


def unpack_codes_scales(row: torch.Tensor, codes_like: torch.Tensor, num_scales: int):
    cb = codes_like.numel() * codes_like.element_size()
    cb_pad = _round_up(cb, 4)
    codes = row[:cb].view(codes_like.dtype).view(codes_like.shape)
    scales = row[cb_pad:cb_pad + 4 * num_scales].view(torch.float32)
    return codes, scales


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
    from megatron_ext.kernels import dequantize_symmetric, quantize_symmetric

    from .plain import local_gather

    done = local_gather(topo, shard, out_bucket)
    if done is not None:
        return done
    n = shard.numel()
    group = gather_group(n, group_size, bits)
    codes, scales = quantize_symmetric(shard.contiguous(), bits=bits, group_size=group)
    row = pack_codes_scales(codes, scales)
    num_scales = scales.numel()
    recv = torch.empty(topo.size * row.numel(), dtype=torch.uint8, device=row.device)
    intra, inter = topo.peers()
    ledger.record_pairwise(name, row.numel(), intra, inter)
    handle = _all_gather(recv, row, group=topo.group, async_op=True)
    P = topo.size
    rows = recv.view(P, row.numel())
    dtype = out_bucket.dtype
    cb = codes.numel() * codes.element_size()
    padded = num_scales * group   # elements a row's codes decode to (groups * group length)

    def epilogue() -> None:
        # One decode of all P rows (per-bucket overhead: one kernel, not P): the rows' codes and scales are
        # gathered into two contiguous blocks; group boundaries coincide with row boundaries, so every element
        # decodes exactly as a per-row decode would.
        all_codes = rows[:, :cb].contiguous().view(codes.dtype).reshape(-1)
        all_scales = rows[:, _round_up(cb, 4):_round_up(cb, 4) + 4 * num_scales].contiguous().view(torch.float32)
        decoded = dequantize_symmetric(all_codes, all_scales.reshape(-1), bits=bits, group_size=group,
                                       numel=P * padded, dtype=dtype)
        out_bucket.view(P, n).copy_(decoded.view(P, padded)[:, :n])

    return TorchWork(handle, epilogue)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """torch >= 2.13 renames all_gather_into_tensor to all_gather_single."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)
