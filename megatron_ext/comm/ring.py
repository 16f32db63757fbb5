"""The ``ring`` gradient reduce-scatter: NCCL's ring algorithm, ``P - 1`` hops over the DP group.

[Note: ring reduce-scatter]
*Why.* torch's gloo process group runs a reduce-scatter as an all-reduce of the whole bucket and keeps its own chunk
(``ProcessGroupGloo::reduce_scatter_tensor_coalesced``; planner/profile.py), so ``plain`` on gloo sends ``2(P-1)/P``
of the bucket per rank where NCCL's ring sends ``(P-1)/P``: on the emulated 2 x 2 cluster 31.9 MB per node and step
instead of 15.9 (docs/benchmarks). A baseline that sends twice the bytes a GPU cluster would flatters every backend
compared with it on a slow link. ``ring`` is the reduce-scatter a GPU cluster runs, on any process group: the
honest fp32 baseline on gloo, and plain's reduction for users whose cluster is a gloo one.

*What.* Rank ``r`` of ``P``, the bucket as ``P`` chunks of ``n`` (chunk ``j`` is shard ``j``). Hop ``k`` (``0 <= k <
P-1``) sends the partial sum of chunk ``(r-k-1) mod P`` to rank ``r+1`` and receives the partial sum of chunk
``(r-k-2) mod P`` from rank ``r-1``, to which it adds its own contribution; after the last hop rank ``r`` holds
chunk ``r`` summed over every rank, and one pass ``(own + received) * 1/P`` writes the shard. Each hop is one
send to the next rank and one receive from the previous (``batch_isend_irecv``: only those two messages, where an
all-to-all would synchronise the whole group every hop). Every rank issues its hops in the same order (the progress
engine's rule, as for any multi-hop work), so the point-to-point messages of one pair match in order. The bucket is
only read; the partial sums go through one ``n``-element buffer (a hop has finished sending it before the next sum
is written). The sums run in the bucket's dtype, as NCCL's, and in ring order, the same on every run.

*Bytes.* Per rank and bucket ``(P-1)*n`` elements to the next rank. Ranks of a node are consecutive, so the last
rank of each node sends across nodes and ``(P-1)*n`` elements per node cross the link (NCCL's ring; a node-aware
two-hop reduction would send ``(N-1)*D*n``, qgZ's structure without its quantization). A DP group whose ranks
interleave nodes is treated as one node (topology.py, with a warning): there every hop may cross nodes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import GradReduce, Work, register_grad_reduce


def ring_bytes(n: int, element_size: int, size: int, ranks_per_node: int, rank: int):
    """Closed form: (intra, inter) bytes rank ``rank`` sends for one bucket of ``size*n`` elements."""
    sent = (size - 1) * n * element_size
    crosses = ranks_per_node < size and (rank + 1) % ranks_per_node == 0
    return (0, sent) if crosses else (sent, 0)


@register_grad_reduce("ring")
class RingGradReduce(GradReduce):
    """NCCL's ring reduce-scatter as ``P - 1`` hops (see the module note)."""

    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        return self._local_reduce_scatter(bucket, out_shard) or _RingWork(self, bucket, out_shard)


class _RingWork(Work):
    """One bucket's ring: hop ``k`` in flight after ``k`` calls of :meth:`advance`, ``P - 1`` hops in all."""

    def __init__(self, backend: RingGradReduce, bucket: torch.Tensor, out_shard: torch.Tensor) -> None:
        topo = backend.topology
        self.P, self.r, self.n = P, r, n = topo.size, topo.rank, out_shard.numel()
        self.group, self.bucket, self.out = topo.group, bucket, out_shard
        intra, inter = ring_bytes(n, bucket.element_size(), P, topo.ranks_per_node, r)
        self.bytes_per_hop = (intra // (P - 1), inter // (P - 1))
        self.ledger = backend.ledger
        self.next_rank = topo.global_ranks[(r + 1) % P]
        self.prev_rank = topo.global_ranks[(r - 1) % P]
        self.acc = torch.empty(n, dtype=bucket.dtype, device=bucket.device)
        self.recv = torch.empty(n, dtype=bucket.dtype, device=bucket.device)
        self.k = 0
        self._handle = None
        self._launch(self.chunk((r - 1) % P))

    def chunk(self, j: int) -> torch.Tensor:
        return self.bucket[j * self.n:(j + 1) * self.n]

    def _launch(self, send: torch.Tensor) -> None:
        self.ledger.record("ring_reduce_scatter", intra=self.bytes_per_hop[0], inter=self.bytes_per_hop[1])
        self._sent = send   # kept alive while on the wire
        self._handle = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next_rank, self.group),
                                               dist.P2POp(dist.irecv, self.recv, self.prev_rank, self.group)])

    def advance(self) -> None:
        if self._handle is None:
            return
        for h in self._handle:
            h.wait()
        self._handle = None
        j = (self.r - self.k - 2) % self.P          # the chunk whose partial sum just arrived
        if self.k == self.P - 2:                    # the last hop: j == r, the shard
            if self.out.dtype == self.bucket.dtype:
                torch.add(self.chunk(j), self.recv, out=self.out).mul_(1.0 / self.P)
            else:
                self.out.copy_(torch.add(self.chunk(j), self.recv)).mul_(1.0 / self.P)
            self._sent = None
            return
        torch.add(self.chunk(j), self.recv, out=self.acc)   # the hop that sent acc has finished
        self.k += 1
        self._launch(self.acc)

    def wait(self) -> None:
        while self._handle is not None:
            self.advance()

    @property
    def done(self) -> bool:
        return self._handle is None
