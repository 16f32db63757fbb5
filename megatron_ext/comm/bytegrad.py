"""The ``bytegrad`` gradient reduce-scatter: Bagua's hierarchical min-max UINT8 scheme (seed 003).

[Note: ByteGrad data flow]
The DP group holds ``N`` nodes of ``D`` ranks; local rank 0 of each node is its *leader*; the leaders form
``inter_group`` of local index 0. For a bucket of ``B = P*n`` elements of ``e`` bytes each:

1. *intra-node reduce* (``intra_group``): the node's ranks sum their buckets onto the leader (bucket dtype);
2. *compress + inter-node all-to-all* (leaders): the node sum is cut into ``N`` chunks of ``L = B/N`` elements
   (chunk ``a`` is node ``a``'s block of shards), each min-max UINT8-compressed with one ``(min, max)`` pair per
   ``bytegrad_chunk_size`` elements (0: one pair per chunk), and chunk ``a`` is sent to leader ``a``;
3. *decompress-average-recompress* (leaders): the ``N`` received versions of the node's block are decompressed, summed
   in fp32 and multiplied by ``1/P`` -- the only averaging step -- and compressed again;
4. *inter-node all-gather* (leaders) of the recompressed blocks, decompressed into the full averaged bucket (the
   leader decodes its own block from the recompressed version too, like every other node);
5. *intra-node broadcast* (``intra_group``) of the averaged bucket from the leader; each rank keeps its shard.

This is Bagua's all-reduce flow (``ByteGradAlgorithm(hierarchical=True, average=True)``, two quantization rounds),
ending in the shard the ZeRO-2 optimizer asks for. Each all-to-all / all-gather chunk is one byte row
``[q (L bytes) | pad to 4 | mins | maxs]`` of ``row = round_up(L, 4) + 8*ceil(L/c)`` bytes. Bytes sent per bucket
(ledger, direct-send model): a non-leader sends ``B*e`` intra-node (reduce); a leader sends ``(N-1)*row`` inter-node
in the all-to-all, ``(N-1)*row`` inter-node in the all-gather and ``(D-1)*B*e`` intra-node in the broadcast. Summed
over the group the cross-node volume is ``2*N*(N-1)*row ~= 2*(N-1)*B`` bytes (UINT8), i.e. ``(N-1)*M`` for M bytes of
bf16 gradients.

One node (``N == 1``): there is no inter-node hop; ByteGrad runs in its flat (non-hierarchical) form, every rank
a leader of a one-rank "node" (logged once per job). One rank per node (``D == 1``): the intra-node steps vanish.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .backend import BackendOptions, CompletedWork, GradReduce, StagedWork, Work, register_grad_reduce
from .ledger import CommLedger
from .topology import Topology


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def bytegrad_row_bytes(chunk_numel: int, minmax_chunk: int) -> int:
    """Bytes of one compressed all-to-all chunk of ``chunk_numel`` elements."""
    c = minmax_chunk if minmax_chunk > 0 else chunk_numel
    return _round_up(chunk_numel, 4) + 8 * (-(-chunk_numel // c))


def bytegrad_bytes(n: int, nodes: int, ranks_per_node: int, elem_size: int, minmax_chunk: int, leader: bool,
                   ) -> tuple[int, int]:
    """Closed form: (intra, inter) bytes one rank sends for one bucket of ``nodes*ranks_per_node*n`` elements.

    A one-node topology runs the flat form (every rank a leader; the exchange is intra-node).
    """
    P = nodes * ranks_per_node
    B = P * n
    if nodes == 1:
        row = bytegrad_row_bytes(n, minmax_chunk)
        return 2 * (P - 1) * row, 0
    D, N = ranks_per_node, nodes
    if not leader:
        return B * elem_size, 0
    row = bytegrad_row_bytes(B // N, minmax_chunk)
    return (D - 1) * B * elem_size, 2 * (N - 1) * row


def _compress(x: torch.Tensor, c: int) -> torch.Tensor:
    """One byte row ``[q | pad | mins | maxs]`` for the fp32/bf16/fp16 chunk ``x``."""
    from megatron_ext.kernels import quantize_minmax_uint8

    q, mins, maxs = quantize_minmax_uint8(x.contiguous(), c)
    L = q.numel()
    lp = _round_up(L, 4)
    k = mins.numel()
    row = torch.empty(lp + 8 * k, dtype=torch.uint8, device=x.device)
    row[:L].copy_(q)
    if lp > L:
        row[L:lp].zero_()
    row[lp:lp + 4 * k].copy_(mins.to(torch.float32).view(torch.uint8))
    row[lp + 4 * k:].copy_(maxs.to(torch.float32).view(torch.uint8))
    return row


def _decompress(row: torch.Tensor, L: int, c: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from megatron_ext.kernels import dequantize_minmax_uint8

    lp = _round_up(L, 4)
    k = -(-L // c)
    q = row[:L]
    mins = row[lp:lp + 4 * k].contiguous().view(torch.float32)
    maxs = row[lp + 4 * k:lp + 8 * k].contiguous().view(torch.float32)
    return dequantize_minmax_uint8(q, mins, maxs, c, L, dtype)


@register_grad_reduce("bytegrad")
class ByteGradGradReduce(GradReduce):
    """Hierarchical min-max UINT8 reduce-scatter; see the module note.

    The work has five phases (reduce to the leader, leaders' all-to-all, average + leaders' all-gather, broadcast,
    copy-out); the first is launched at once, each ``advance()`` completes one and launches the next.
    """

    def __init__(self, topology: Topology, ledger: CommLedger, options: BackendOptions) -> None:
        super().__init__(topology, ledger, options)
        topo = self.topology
        if topo.num_nodes == 1 and topo.size > 1:
            self._warn_once(f"bytegrad on a single node ({topo.size} ranks): using the flat (non-hierarchical) form")

    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        topo = self.topology
        n = out_shard.numel()
        P = topo.size
        if bucket.numel() != n * P:
            raise ValueError(f"bucket of {bucket.numel()} elements does not split into {P} shards of {n}")
        if P == 1:
            out_shard.copy_(bucket)
            return CompletedWork()
        if n == 0:
            return CompletedWork()
        r = topo.rank
        return self._flow(bucket, lambda result: out_shard.copy_(result[r * n:(r + 1) * n]))

    @property
    def all_reduce_alignment(self) -> int:
        return self.topology.num_nodes if self.topology.num_nodes > 1 else self.topology.size

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """Bagua's own flow is an all-reduce: every rank keeps the whole averaged bucket."""
        if self.topology.size == 1 or tensor.numel() == 0:
            return CompletedWork()
        return self._flow(tensor, tensor.copy_)

    def _flow(self, bucket: torch.Tensor, finish_with) -> Work:
        """The five phases of the module note; ``finish_with(result)`` stores the averaged bucket's part wanted."""
        topo = self.topology
        P = topo.size
        if topo.num_nodes == 1:   # flat form (announced at construction)
            nodes, D, intra_group, leader_group, leader = P, 1, None, topo.group, True
            leader_global = topo.global_rank(topo.rank)
        else:
            nodes, D = topo.num_nodes, topo.ranks_per_node
            intra_group = topo.intra_group if D > 1 else None
            leader = topo.local_rank == 0
            leader_group = topo.inter_group if leader else None
            leader_global = topo.global_rank(topo.node * D)
        # Which leader-group peers share this rank's node (flat form: all of them; hierarchical: none).
        leader_peers_intra = nodes - 1 if topo.num_nodes == 1 else 0
        leader_peers_inter = 0 if topo.num_nodes == 1 else nodes - 1
        L = bucket.numel() // nodes
        c = self.options.bytegrad_chunk_size or L
        c = min(c, L)
        elem = bucket.element_size()
        ledger = self.ledger
        st: dict = {}

        def reduce_phase() -> List:
            work = bucket.clone()
            st["work"] = work
            if D == 1:
                return []
            ledger.record("bytegrad_intra_reduce", intra=0 if leader else bucket.numel() * elem)
            return [dist.reduce(work, dst=leader_global, op=dist.ReduceOp.SUM, group=intra_group, async_op=True)]

        def all_to_all_phase() -> List:
            if not leader:
                return []
            rows = torch.stack([_compress(ch, c) for ch in st["work"].view(nodes, L)])
            st.pop("work")
            recv = torch.empty_like(rows)
            row = rows.shape[1]
            ledger.record("bytegrad_inter_all_to_all", intra=leader_peers_intra * row, inter=leader_peers_inter * row)
            st["recv"] = recv
            return [dist.all_to_all_single(recv.view(-1), rows.view(-1), group=leader_group, async_op=True)]

        def average_gather_phase() -> List:
            if not leader:
                return []
            recv = st.pop("recv")
            acc = torch.zeros(L, dtype=torch.float32, device=bucket.device)
            for a in range(nodes):
                acc.add_(_decompress(recv[a], L, c))
            acc.mul_(1.0 / P)   # the one and only averaging (sum over all P ranks / P)
            row = _compress(acc, c)
            gathered = torch.empty(nodes, row.numel(), dtype=torch.uint8, device=row.device)
            ledger.record("bytegrad_inter_all_gather", intra=leader_peers_intra * row.numel(),
                          inter=leader_peers_inter * row.numel())
            st["gathered"] = gathered
            return [_all_gather(gathered.view(-1), row, group=leader_group, async_op=True)]

        def broadcast_phase() -> List:
            if leader:
                gathered = st.pop("gathered")
                result = torch.empty_like(bucket)
                for a in range(nodes):
                    result[a * L:(a + 1) * L].copy_(_decompress(gathered[a], L, c, bucket.dtype))
            else:
                result = torch.empty_like(bucket)
            st["result"] = result
            if D == 1:
                return []
            ledger.record("bytegrad_intra_broadcast", intra=(D - 1) * bucket.numel() * elem if leader else 0)
            return [dist.broadcast(result, src=leader_global, group=intra_group, async_op=True)]

        def finish() -> List:
            finish_with(st.pop("result"))
            return []

        return StagedWork([reduce_phase, all_to_all_phase, average_gather_phase, broadcast_phase, finish])


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """torch >= 2.13 renames all_gather_into_tensor to all_gather_single."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)
