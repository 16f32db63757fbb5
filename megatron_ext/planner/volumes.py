"""Closed-form communication of one training step: every collective a rank issues, with its bytes per link class.

[Note: one source for bytes]
The byte counts come from the backends' own closed forms (``qgz_bytes``, ``qwz_row_bytes``, ``bytegrad_bytes`` and
the pairwise model of the ledger for the plain collectives), applied to the exact padded buckets the ODO builds
(``optimizer.bucketing.assign_buckets`` on the model's parameter numels). The same calls feed the ledger check
(tests: these sums equal ``model.ledger`` for every plan that runs) and the time model (``planner/cost.py``), so
the planner can never predict a time for traffic the ODO does not send.

Per step with ``M`` micro-batches (a rank's view; ``G`` group size, ``D`` of its ranks per node):

- gradient reduction inside the optim group: every micro-batch (grad = optim) or once (grad = 1: full gradients
  accumulated locally); ZeRO-3 reduces every micro-batch;
- across the optim group's replicas: one all-reduce of the shard at the micro-batch that completes the step;
- weights: one all-gather inside the optim group after the step (full parameters), or -- ZeRO-3 -- a forward and a
  backward gather per micro-batch, the backward one from the hpZ pieces inside the node when ``hpz > 1``;
- a stage whose group crosses nodes runs the chosen gradient backend; a node-local stage runs ``plain`` (unless no
  stage crosses nodes), as ``optimizer/plan_comm.py`` does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..comm.bytegrad import bytegrad_bytes
from ..comm.qgz import qgz_bytes
from ..comm.qwz import qwz_row_bytes
from ..comm.ring import ring_bytes
from ..optimizer.plan_comm import stage_backend_names, stage_group_shapes
from ..optimizer.sharding import ResolvedPlan
from .candidate import Candidate


@dataclasses.dataclass(frozen=True)
class Group:
    """A collective's group: ``size`` ranks, ``per_node`` of them on each of its ``nodes`` nodes."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @property
    def peers(self) -> Tuple[int, int]:
        return self.per_node - 1, self.size - self.per_node


def plan_groups(plan: ResolvedPlan) -> Tuple[Group, Optional[Group]]:
    """The optim group and the replica group (None: one replica) of a plan, as the ODO builds them."""
    optim, replicas = stage_group_shapes(plan)
    return Group(*optim), (Group(*replicas) if replicas is not None else None)


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective (or one hop of a multi-hop one) a rank issues in a step.

    ``intra`` / ``inter``: bytes this rank sends (ledger model). ``hop``: position inside a chained reduction (a
    hop waits for the previous one of the same ``key``). ``kernel_elems``: elements the quantize / dequantize
    kernels read for this hop on this rank; ``reduce_elems``: those read by the fused reductions (slower per element);
    ``requant_elems``: those read by the INT4 dequantize-reduce-requantize, a kernel of its own (native C on CPU).
    """

    name: str            # ledger row
    op: str              # reduce_scatter | all_gather | all_reduce | all_to_all | reduce | broadcast
    phase: str           # grad | replica | gather | fwd_gather | bwd_gather
    bucket: int
    group: Group
    intra: int
    inter: int
    key: Tuple = ()
    hop: int = 0
    kernel_elems: int = 0
    reduce_elems: int = 0    # elements read by qgZ's fused dequantize-reduce(-requantize) kernels
    requant_elems: int = 0   # ... by the INT4 dequantize-reduce-requantize (its own rate: requant_kernel_bytes_per_s)
    micro_batch: int = 0


@dataclasses.dataclass(frozen=True)
class BucketShape:
    numel: int          # padded elements (optim shards x shard_numel)
    shard_numel: int


@dataclasses.dataclass(frozen=True)
class WireOptions:
    param_bytes: int = 2         # model dtype bytes (bf16)
    grad_bytes: int = 4          # reduction dtype bytes (fp32 with grad_reduce_in_fp32, the megatron default)
    quant_group_size: int = 2048
    qgz_pipeline_stages: int = 2
    bytegrad_chunk_size: int = 0


# -- one reduction / gather per backend ---------------------------------------------------------------------
def _reduce_scatter(backend: str, bits: int, n: int, g: Group, e: int, o: WireOptions, local_rank: int,
                    **tag) -> List[Call]:
    """Reduce-scatter of ``g.size * n`` elements into ``n`` per rank."""
    if g.size == 1 or n == 0:
        return []
    if backend == "qgz":
        intra, inter = qgz_bytes(n, g.nodes, g.per_node, bits, o.qgz_pipeline_stages, o.quant_group_size)
        B = n * g.size
        calls = []
        if g.per_node > 1:
            reduce = {"requant_elems" if bits == 4 else "reduce_elems": B}  # dequant-reduce-requant
            calls.append(Call("qgz_intra_all_to_all", "all_to_all", intra=intra, inter=0, group=g, hop=0,
                              kernel_elems=B, **reduce, **tag))   # and swizzle+quantize
        if g.nodes > 1:
            calls.append(Call("qgz_inter_all_to_all", "all_to_all", intra=0, inter=inter, group=g, hop=1,
                              reduce_elems=B // g.per_node, **tag))    # dequant-reduce of the nodes' sums
        return calls
    if backend == "bytegrad":
        return _bytegrad(n, g, e, o, local_rank, all_reduce=False, **tag)
    if backend == "ring":   # P-1 hops, one partial sum to the next rank each (comm/ring.py); the node's last rank
        # sends across nodes, and every hop waits for that edge; a hop is costed as the calibrated all-to-all's
        intra, inter = ring_bytes(n, e, g.size, g.per_node, local_rank)
        return [Call("ring_reduce_scatter", "all_to_all", intra=intra // (g.size - 1), inter=inter // (g.size - 1),
                     group=g, hop=k, reduce_elems=n, **tag) for k in range(g.size - 1)]
    a, b = g.peers
    return [Call("reduce_scatter", "reduce_scatter", intra=a * n * e, inter=b * n * e, group=g, **tag)]


def _bytegrad(n: int, g: Group, e: int, o: WireOptions, local_rank: int, all_reduce: bool, **tag) -> List[Call]:
    """ByteGrad's hops (``comm/bytegrad.py``): the reduce-scatter ends in a node-local scatter of the leader's
    averaged block; the all-reduce (Bagua's whole flow) re-compresses it, all-gathers and broadcasts the bucket."""
    leader = local_rank == 0
    intra, inter = bytegrad_bytes(n, g.nodes, g.per_node, e, o.bytegrad_chunk_size, leader, all_reduce)
    B = n * g.size
    L = B // g.nodes
    if g.nodes == 1:
        kernels = 3 * B if all_reduce else 2 * B      # compress, decompress (all-reduce: and the gathered rows)
        return [Call("bytegrad_flat", "all_to_all", intra=intra, inter=0, group=g, kernel_elems=kernels, **tag)]
    reduce = Call("bytegrad_intra_reduce", "reduce", intra=0 if leader else intra, inter=0, group=g, hop=0, **tag)
    if not all_reduce:   # the leader compresses the node's sum (B) and decompresses the N versions of its block
        return [reduce,
                Call("bytegrad_inter_all_to_all", "all_to_all", intra=0, inter=inter, group=g, hop=1,
                     kernel_elems=2 * B if leader else 0, **tag),
                Call("bytegrad_intra_scatter", "scatter", intra=intra if leader else 0, inter=0, group=g, hop=2,
                     **tag)]
    half = inter // 2
    return [reduce,
            Call("bytegrad_inter_all_to_all", "all_to_all", intra=0, inter=half, group=g, hop=1,
                 kernel_elems=2 * B + L if leader else 0, **tag),   # and re-compresses the averaged block
            Call("bytegrad_inter_all_gather", "all_gather", intra=0, inter=inter - half, group=g, hop=2,
                 kernel_elems=B if leader else 0, **tag),
            Call("bytegrad_intra_broadcast", "broadcast", intra=intra if leader else 0, inter=0, group=g, hop=3,
                 **tag)]


def _all_reduce(backend: str, bits: int, numel: int, g: Group, e: int, o: WireOptions, local_rank: int,
                **tag) -> List[Call]:
    """All-reduce of a ``numel``-element shard across the replicas (``GradReduce.all_reduce``)."""
    if g.size == 1 or numel == 0:
        return []
    if backend == "plain":
        a, b = g.peers
        per_peer = math.ceil(2 * numel * e / g.size)
        return [Call("all_reduce", "all_reduce", intra=a * per_peer, inter=b * per_peer, group=g, **tag)]
    if backend == "bytegrad":   # Bagua's own flow is an all-reduce
        return _bytegrad(numel // g.size, g, e, o, local_rank, all_reduce=True, **tag)
    piece = numel // g.size
    if backend == "ring":       # the ring reduce-scatter, then a full-precision all-gather of the pieces
        calls = _reduce_scatter("ring", bits, piece, g, e, o, local_rank, **tag)
        a, b = g.peers
        return calls + [Call("all_reduce_all_gather", "all_gather", intra=a * piece * e, inter=b * piece * e,
                             group=g, hop=len(calls), **tag)]
    # qgZ: quantized reduce-scatter, then a quantized all-gather of the pieces
    calls = _reduce_scatter("qgz", bits, piece, g, e, o, local_rank, **tag)
    row = qwz_row_bytes(piece, o.quant_group_size, bits)
    a, b = g.peers
    last = max((c.hop for c in calls), default=-1)
    calls.append(Call("qgz_all_gather", "all_gather", intra=a * row, inter=b * row, group=g, hop=last + 1,
                      kernel_elems=piece + numel, **tag))
    return calls


def _all_gather(backend: str, n: int, g: Group, e: int, o: WireOptions, name: str = "all_gather",
                **tag) -> List[Call]:
    if g.size == 1 or n == 0:
        return []
    a, b = g.peers
    if backend == "qwz":
        row = qwz_row_bytes(n, o.quant_group_size)
        return [Call("qwz_all_gather", "all_gather", intra=a * row, inter=b * row, group=g,
                     kernel_elems=n + n * g.size, **tag)]
    return [Call(name, "all_gather", intra=a * n * e, inter=b * n * e, group=g, **tag)]


# -- a whole step -------------------------------------------------------------------------------------------
def group_local_ranks(plan: ResolvedPlan) -> Tuple[int, int]:
    """Rank ``plan.dp_rank``'s position among its node's members of the optim group and of the replica group: the
    only thing in which the calls of one node's ranks differ (ByteGrad's leaders are position 0)."""
    rpn = plan.ranks_per_node
    local = plan.dp_rank % rpn
    optim_local = local % plan.optim if plan.optim < rpn else local
    replica_local = (local // plan.optim) if plan.replicas > 1 and plan.optim < rpn else 0
    return optim_local, replica_local


def step_calls(cand: Candidate, plan: ResolvedPlan, buckets: Sequence[BucketShape], micro_batches: int,
               wire: WireOptions = WireOptions()) -> List[Call]:
    """Every call DP rank ``plan.dp_rank`` issues in one steady-state step, in issue order per bucket."""
    M = micro_batches
    optim, replicas = plan_groups(plan)
    optim_backend, replica_backend = stage_backend_names(plan, cand.grad_reduce)

    bits, e_g, e_p = cand.qgz_bits, wire.grad_bytes, wire.param_bytes
    zero3 = plan.param > 1
    every_micro = zero3 or not plan.accumulates_locally(M > 1)
    reductions = range(M) if every_micro else [M - 1]
    calls: List[Call] = []
    optim_local, replica_local = group_local_ranks(plan)
    for k, b in enumerate(buckets):
        n = b.shard_numel
        for m in range(M):
            if zero3:
                calls += _all_gather(cand.param_gather, n, optim, e_p, wire, phase="fwd_gather", bucket=k,
                                     key=("fg", k, m), micro_batch=m)
                if plan.hpz > 1:
                    hg = Group(plan.hpz, plan.hpz)
                    calls += _all_gather("plain", b.numel // plan.hpz, hg, e_p, wire, name="hpz_all_gather",
                                         phase="bwd_gather", bucket=k, key=("bg", k, m), micro_batch=m)
                else:
                    calls += _all_gather(cand.param_gather, n, optim, e_p, wire, phase="bwd_gather", bucket=k,
                                         key=("bg", k, m), micro_batch=m)
            if m in reductions:
                calls += _reduce_scatter(optim_backend, bits, n, optim, e_g, wire, optim_local, phase="grad",
                                         bucket=k, key=("rs", k, m), micro_batch=m)
        if replicas is not None:
            rs = _reduce_scatter(optim_backend, bits, n, optim, e_g, wire, optim_local, phase="grad", bucket=k)
            first = max((c.hop for c in rs), default=-1) + 1
            for c in _all_reduce(replica_backend, bits, n, replicas, e_g, wire, replica_local, phase="replica",
                                 bucket=k, key=("rs", k, M - 1), micro_batch=M - 1):
                calls.append(dataclasses.replace(c, hop=c.hop + first))
        if not zero3:
            calls += _all_gather(cand.param_gather, n, optim, e_p, wire, phase="gather", bucket=k, key=("ag", k))
    return calls


def ledger_totals(calls: Sequence[Call]) -> Dict[str, int]:
    """``{"intra": bytes, "inter": bytes}`` one rank sends per step (the ledger's totals, scalar rows excluded)."""
    return {"intra": sum(c.intra for c in calls), "inter": sum(c.inter for c in calls)}


def ledger_rows(calls: Sequence[Call]) -> Dict[str, List[int]]:
    """``{ledger row: [intra, inter]}``."""
    out: Dict[str, List[int]] = {}
    for c in calls:
        row = out.setdefault(c.name, [0, 0])
        row[0] += c.intra
        row[1] += c.inter
    return out
