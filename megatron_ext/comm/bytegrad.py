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
5. *intra-node broadcast* (``intra_group``) of the averaged bucket from the leader.

Steps 1-5 are Bagua's all-reduce flow (``ByteGradAlgorithm(hierarchical=True, average=True)``, two quantization
rounds): :meth:`ByteGradGradReduce.all_reduce` runs it, for the replica all-reduce of a sharding plan. A ZeRO
reduce-scatter needs less. Node ``a``'s block of shards (ranks ``a*D .. a*D+D-1``) is exactly what leader ``a``
holds after step 3, so :meth:`~ByteGradGradReduce.reduce_scatter` stops there: it skips the recompression and the
all-gather (the second half of an all-reduce: half of the cross-node bytes) and ends in an *intra-node scatter*
(4') of the averaged block, each local rank receiving its own ``n``-element shard in the bucket dtype instead of the
whole bucket. One quantization round, three hops instead of four.

Each all-to-all / all-gather chunk is one byte row ``[q (L bytes) | pad to 4 | mins | maxs]`` of
``row = round_up(L, 4) + 8*ceil(L/c)`` bytes. Bytes sent per bucket (ledger, direct-send model): a non-leader sends
``B*e`` intra-node (reduce); a leader sends ``(N-1)*row`` inter-node in the all-to-all, and then, in the
reduce-scatter, ``(D-1)*n*e`` intra-node in the scatter; in the all-reduce, ``(N-1)*row`` inter-node in the
all-gather and ``(D-1)*B*e`` intra-node in the broadcast. Summed over the group the cross-node volume is
``N*(N-1)*row ~= (N-1)*B`` bytes (UINT8) for the reduce-scatter, i.e. ``(N-1)*M/2`` for M bytes of bf16
gradients, and twice that for the all-reduce.

One node (``N == 1``): there is no inter-node hop; ByteGrad runs in its flat (non-hierarchical) form, every rank
a leader of a one-rank "node" (logged once per job). One rank per node (``D == 1``): the intra-node steps vanish.

Copies: the bucket is cloned only where the intra-node reduce writes into it (``D > 1``); otherwise step 2 reads it
where it lies. Results are written where they end up: the averaged block into ``out_shard`` at ``D == 1`` (and the
scatter receives into it), and in the all-reduce the gathered rows decode straight into the bucket, which the
broadcast then fills in place on the other ranks (:func:`_decode_rows`).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .backend import BackendOptions, CompletedWork, GradReduce, StagedWork, Work, register_grad_reduce
from .ledger import CommLedger
from .topology import Topology
from .wire import empty_rows, row_bytes, unpack_rows


def bytegrad_row_bytes(chunk_numel: int, minmax_chunk: int) -> int:
    """Bytes of one compressed all-to-all chunk of ``chunk_numel`` elements: a wire row (``comm/wire.py``) whose
    "scales" are the chunk's mins then maxs."""
    c = minmax_chunk if minmax_chunk > 0 else chunk_numel
    return row_bytes(chunk_numel, 2 * (-(-chunk_numel // c)))


def bytegrad_bytes(n: int, nodes: int, ranks_per_node: int, elem_size: int, minmax_chunk: int, leader: bool,
                   all_reduce: bool = False) -> tuple[int, int]:
    """Closed form: (intra, inter) bytes one rank sends for one bucket of ``nodes*ranks_per_node*n`` elements,
    reduce-scattered (default) or all-reduced (``all_reduce``: Bagua's whole flow).

    A one-node topology runs the flat form (every rank a leader; the exchange is intra-node).
    """
    P = nodes * ranks_per_node
    B = P * n
    rounds = 2 if all_reduce else 1     # the all-to-all, and for the all-reduce the all-gather
    if nodes == 1:
        return rounds * (P - 1) * bytegrad_row_bytes(n, minmax_chunk), 0
    D, N = ranks_per_node, nodes
    if not leader:
        return B * elem_size, 0
    row = bytegrad_row_bytes(B // N, minmax_chunk)
    return (D - 1) * (B if all_reduce else n) * elem_size, rounds * (N - 1) * row


# row buffers quantized or decoded by one call up to this many bytes (the Triton kernels index with int32;
# above, row by row)
_ONE_CALL_BYTES = 1 << 30


def _compress(x: torch.Tensor, c: int) -> torch.Tensor:
    """One byte row ``[q | pad | mins | maxs]`` for the fp32/bf16/fp16 chunk ``x``."""
    return _compress_rows(x.reshape(1, -1), c)[0]


def _compress_rows(x: torch.Tensor, c: int) -> torch.Tensor:
    """The rows ``[q | pad | mins | maxs]`` of the ``[rows, L]`` tensor ``x``, one per row, quantized straight into
    the rows (in place on CUDA). When ``c`` divides ``L`` no (min, max) chunk straddles two rows, so all rows are
    quantized by one call (3 kernel launches instead of 3 per row) and decode to the values row-by-row calls give:
    the codes, scales and offsets are the same; a chunk's min of 0 may keep either sign, which no decoded value
    depends on. Otherwise row by row."""
    from megatron_ext.kernels import quantize_minmax_uint8

    rows, L = x.shape
    k = -(-L // c)
    buf, q, minmax = empty_rows(rows, L, 2 * k, torch.uint8, x.device)
    x = x.contiguous()
    if rows > 1 and (L % c or buf.numel() > _ONE_CALL_BYTES):   # the offsets run over the whole row buffer
        for r in range(rows):
            quantize_minmax_uint8(x[r], c, out=(q[r:r + 1], minmax[r:r + 1, :k], minmax[r:r + 1, k:]))
    else:
        quantize_minmax_uint8(x.view(-1), c, out=(q, minmax[:, :k], minmax[:, k:]))
    return buf


def _decode_rows(rows: torch.Tensor, L: int, c: int, out: torch.Tensor) -> torch.Tensor:
    """Each of the ``[nodes, row]`` gathered rows decoded where it lies into its ``L`` elements of ``out`` (``nodes *
    L`` contiguous elements): one call, no temporaries, no copies."""
    from megatron_ext.kernels import dequantize_minmax_rows

    nodes, chunks = rows.shape[0], -(-L // c)
    q, minmax = unpack_rows(rows, nodes, L, torch.uint8, 2 * chunks)
    dequantize_minmax_rows(q, minmax[:, :chunks], minmax[:, chunks:], c, out=out.view(nodes, L))
    return out


def _decode_average(recv: torch.Tensor, L: int, c: int, P: int, dtype: torch.dtype,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``[nodes, row]`` received rows decoded where they lie, summed in fp32 in node order and multiplied by 1/P
    (the one and only averaging), as ``dtype`` (into ``out`` when given): one kernel. The sum starts at node 0's
    version, which equals starting at zeros bit for bit (0 + d == d): d = (q + lb) / scale is never -0.0, since
    q + lb is a whole number (+0.0 when zero) and a non-zero one is at least 1 against scale <= 2.55e9."""
    from megatron_ext.kernels import dequantize_minmax_reduce

    nodes, chunks = recv.shape[0], -(-L // c)
    q, minmax = unpack_rows(recv, nodes, L, torch.uint8, 2 * chunks)
    mins, maxs = minmax[:, :chunks], minmax[:, chunks:]
    if recv.numel() <= _ONE_CALL_BYTES:
        return dequantize_minmax_reduce(q, mins, maxs, c, L, factor=1.0 / P, dtype=dtype, out=out)
    # offsets over the whole buffer would pass int32 (Triton): one row a call, summed as the kernel sums
    acc = dequantize_minmax_reduce(q[:1], mins[:1], maxs[:1], c, L)
    for a in range(1, nodes):
        acc.add_(dequantize_minmax_reduce(q[a:a + 1], mins[a:a + 1], maxs[a:a + 1], c, L))
    acc.mul_(1.0 / P)
    return acc.to(dtype) if out is None else out.copy_(acc.view(out.shape))


@register_grad_reduce("bytegrad")
class ByteGradGradReduce(GradReduce):
    """Hierarchical min-max UINT8 reduce-scatter (and all-reduce); see the module note.

    The work is a :class:`StagedWork`: the first hop is launched at once, each ``advance()`` completes one hop and
    launches the next (reduce-scatter: reduce to the leader, leaders' all-to-all, scatter; all-reduce: reduce,
    all-to-all, all-gather, broadcast).
    """

    def __init__(self, topology: Topology, ledger: CommLedger, options: BackendOptions) -> None:
        super().__init__(topology, ledger, options)
        topo = self.topology
        if topo.num_nodes == 1 and topo.size > 1:
            self._warn_once(f"bytegrad on a single node ({topo.size} ranks): using the flat (non-hierarchical) form")

    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        return self._local_reduce_scatter(bucket, out_shard) or self._flow(bucket, out_shard)

    @property
    def all_reduce_alignment(self) -> int:
        return self.topology.num_nodes if self.topology.num_nodes > 1 else self.topology.size

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """Bagua's own flow is an all-reduce: every rank keeps the whole averaged bucket."""
        if self.topology.size == 1 or tensor.numel() == 0:
            return CompletedWork()
        return self._flow(tensor, None)

    def _flow(self, bucket: torch.Tensor, out_shard: Optional[torch.Tensor]) -> Work:
        """The hops of the module note: a reduce-scatter into ``out_shard``, or (``None``) an all-reduce in place."""
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
            if D == 1:   # nothing is summed into it: the compression reads the bucket where it lies
                st["work"] = bucket.contiguous()
                return []
            st["work"] = work = bucket.clone()   # the leader's reduce writes the node sum into it
            ledger.record("bytegrad_intra_reduce", intra=0 if leader else bucket.numel() * elem)
            return [dist.reduce(work, dst=leader_global, op=dist.ReduceOp.SUM, group=intra_group, async_op=True)]

        def all_to_all_phase() -> List:
            if not leader:
                return []
            rows = _compress_rows(st["work"].view(nodes, L), c)
            st.pop("work")
            recv = torch.empty_like(rows)
            row = rows.shape[1]
            ledger.record("bytegrad_inter_all_to_all", intra=leader_peers_intra * row, inter=leader_peers_inter * row)
            st["recv"] = recv
            return [dist.all_to_all_single(recv.view(-1), rows.view(-1), group=leader_group, async_op=True)]

        def average(dtype: torch.dtype) -> torch.Tensor:
            """Leader: this node's block of the bucket, summed over all P ranks and averaged, as ``dtype``."""
            return _decode_average(st.pop("recv"), L, c, P, dtype)

        # -- reduce-scatter: the node's averaged block is its ranks' shards; scatter them inside the node --------
        def scatter_phase() -> List:
            n = out_shard.numel()
            # this rank's shard lands in out_shard itself where it can (no copy at the end)
            direct = out_shard.dtype == bucket.dtype and out_shard.is_contiguous()
            st["result"] = mine = out_shard if direct else torch.empty(n, dtype=bucket.dtype, device=bucket.device)
            if leader:
                if D == 1:   # the node's block is this rank's shard
                    _decode_average(st.pop("recv"), L, c, P, bucket.dtype, out=mine)
                    return []
                shards = list(average(bucket.dtype).view(D, n).unbind(0))
                # scatter_list in intra-group rank order (group ranks follow the global ranks' order)
                order = sorted(range(D), key=lambda b: topo.global_rank(topo.node * D + b))
                ledger.record("bytegrad_intra_scatter", intra=(D - 1) * n * elem)
                return [dist.scatter(mine, [shards[b] for b in order], src=leader_global, group=intra_group,
                                     async_op=True)]
            ledger.record("bytegrad_intra_scatter", intra=0)
            return [dist.scatter(mine, None, src=leader_global, group=intra_group, async_op=True)]

        # -- all-reduce: Bagua's second half, every node gets every block ---------------------------------------
        def gather_phase() -> List:
            if not leader:
                return []
            row = _compress(average(torch.float32), c)
            gathered = torch.empty(nodes, row.numel(), dtype=torch.uint8, device=row.device)
            ledger.record("bytegrad_inter_all_gather", intra=leader_peers_intra * row.numel(),
                          inter=leader_peers_inter * row.numel())
            st["gathered"] = gathered
            return [_all_gather(gathered.view(-1), row, group=leader_group, async_op=True)]

        def broadcast_phase() -> List:
            # the all-reduce is in place: the gathered rows decode (leader) or arrive (others) in the bucket itself,
            # which nothing reads after the first phase (its clone, or at D == 1 the compression, took its values)
            result = bucket if bucket.is_contiguous() else torch.empty_like(bucket)
            if leader:
                _decode_rows(st.pop("gathered"), L, c, result)
            st["result"] = result
            if D == 1:
                return []
            ledger.record("bytegrad_intra_broadcast", intra=(D - 1) * bucket.numel() * elem if leader else 0)
            return [dist.broadcast(result, src=leader_global, group=intra_group, async_op=True)]

        def finish() -> List:
            result, target = st.pop("result"), (out_shard if out_shard is not None else bucket)
            if result is not target:
                target.copy_(result)
            return []

        if out_shard is not None:
            return StagedWork([reduce_phase, all_to_all_phase, scatter_phase, finish])
        return StagedWork([reduce_phase, all_to_all_phase, gather_phase, broadcast_phase, finish])


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """torch >= 2.13 renames all_gather_into_tensor to all_gather_single."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)
