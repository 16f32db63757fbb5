"""Step time of a candidate: the ODO's overlap structure replayed on two communication channels.

[Note: the overlap model]
One step is replayed in program order on three timelines: the compute stream (forward, backward, optimizer; plus
the quantization kernels, the launch cost, a quantized hop's host time on a GPU (``codec_host_s``: at small
buckets the host, not the link, bounds the quantized backends there) and -- CPU ranks -- each hop's own processor
time (``hop_cpu_s``) where they share the processor) and two communication channels,
``intra`` (NVLink / shared memory) and ``inter`` (the node's NICs). A collective occupies the channels its bytes
use (both for a group spanning nodes) and starts when it is issued and its channels are free. Every hop is issued
by the progress engine (``comm/progress.py``, on by default; a thread on CPU, inline on CUDA, one rule) under its
rule, replayed by :class:`_Replay`: a launch issues the new work's first hop and advances each older multi-hop work
(qgZ, ByteGrad, a reduce-scatter chained to the replicas' all-reduce) by one hop once its current hop has ended (on
CUDA the communication stream waits for it, not a thread: the same timeline); a wait issues every remaining hop
of every work launched up to the one waited for. Weight gathers are issued by the training thread itself (not on
the engine) and waited for bucket by bucket. Without the engine (``--no-odo-progress-engine``) the reductions'
hops are issued on the training thread too, which the model does not charge (it is optimistic there).
What the ODO overlaps:

- forward: the weights' all-gathers, issued after the previous step in forward order, are waited for bucket by
  bucket (a forward segment starts when its bucket has arrived); ZeRO-3 gathers every micro-batch, prefetching up
  to ``gather_pool_size`` buckets ahead, and re-gathers for backward (from the hpZ pieces inside the node);
- backward: a bucket's reduction is issued when its gradients are complete (after its backward segment), on the
  micro-batches that reduce (every one with grad = optim, the last with grad = 1), so it overlaps the backward of
  the buckets after it; with pooled buffers (no local accumulation) a bucket's backward first waits for the
  reduction ``buffer_pool_size`` launches back (buffer alternation); the step waits for the last one (the
  exposed tail);
- the optimizer runs after every reduction completed; then the next step's gathers are issued.

Compute per bucket is proportional to its parameters (a transformer's FLOPs are); backward is twice the forward
(three times for the layers fully recomputed: all of them, or with ``block`` the first ``recompute_num_layers``
of a stage), plus the gradient hooks' copies into the bucket buffers; compute overlapped by communication is
``overlap_slowdown`` slower (the profile's note). Work that differs between a node's ranks
(ByteGrad's leader quantizes and broadcasts, the others do not) is the busiest rank's on GPUs, and the node's mean
where the ranks share the processors (CPU profiles: ``kernels_on_compute``, ``intra_on_compute``): a rank that waits
gives its cores to the one that works. The step time is the second of two replayed steps (steady state: the first
step's gathers overlap the second step's forward). Exposed communication = step time - compute alone.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..optimizer.sharding import ResolvedPlan
from .candidate import Candidate
from .memory import TrainingSetup, bucket_shapes, model_state_memory, transient_memory
from .model_spec import ModelSpec
from .profile import HardwareProfile, steps
from .volumes import BucketShape, Call, WireOptions, group_local_ranks, step_calls

_RING_OPS = ("reduce_scatter", "all_gather", "all_reduce")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The training job: model, parallel layout and batch."""

    spec: ModelSpec
    dp: int
    ranks_per_node: int               # DP ranks per node
    micro_batch: int
    micro_batches: int                # per step and DP rank: global batch / (micro batch x DP)
    tp: int = 1
    pp: int = 1
    recompute: str = "none"           # --recompute-granularity: none | selective | full
    setup: TrainingSetup = TrainingSetup()
    sequence_parallel: bool = False
    # With recompute = "full": --recompute-method (uniform | block) and --recompute-num-layers. None: every layer
    # recomputed on its own (uniform, 1), the seeds' full recomputation.
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None

    @property
    def recomputed_fraction(self) -> float:
        """Share of a stage's layers whose forward runs again in backward: every one with full uniform
        recomputation, the first ``recompute_num_layers`` with block."""
        if self.recompute != "full":
            return 0.0
        if self.recompute_method == "block":
            layers = -(-self.spec.num_layers // self.pp)
            return min(self.recompute_num_layers or 1, layers) / layers
        return 1.0

    @property
    def deferred_numel(self) -> int:
        """The busiest stage's elements whose gradients are reduced over a model-parallel group before DP: the ODO
        keeps their buckets in buffers of their own ([Note: deferred buffers] in ``optimizer/grad_sync.py``)."""
        return self.spec.stage_deferred_numel(self.tp, self.pp, self.spec.busiest_stage(self.tp, self.pp),
                                              self.sequence_parallel)

    def wire(self) -> WireOptions:
        s = self.setup
        return WireOptions(param_bytes=s.param_bytes, grad_bytes=s.grad_bytes, quant_group_size=s.quant_group_size,
                           qgz_pipeline_stages=s.qgz_pipeline_stages)


@dataclasses.dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_s: float
    compute_s: float
    exposed_s: float
    memory: Dict[str, int]            # model_states, activations, transient, total (bytes per GPU)
    inter_bytes_per_node: int         # cross-node bytes one node sends per step (ledger model)
    wire_bytes_per_node: int          # the same on the wire under the profile's algorithm (ring: NCCL's count)
    intra_bytes_per_rank: int
    collectives: int                  # collective calls (hops) per rank per step
    flops_per_gpu: float              # model FLOPs per GPU per step

    def mfu(self, profile: HardwareProfile) -> float:
        return self.flops_per_gpu / (self.step_s * profile.peak_flops)


@dataclasses.dataclass(frozen=True)
class _Timed:
    call: Call
    duration: float
    links: Tuple[str, ...]
    kernel_s: float
    intra_s: float           # the node-local link's share (what a CPU's cores spend copying)


def _time_calls(cand: Candidate, wl: Workload, profile: HardwareProfile, buckets: Sequence[BucketShape]
                ) -> Tuple[List[_Timed], int, int, int]:
    """Each call of rank 0 with its duration; per step: cross-node bytes per node (ledger model and on the wire
    under the profile's algorithm) and bytes per rank inside a node."""
    rpn = wl.ranks_per_node
    # Every rank of a node sends alike, except ByteGrad's leaders and the ring's node-crossing last rank: one
    # representative rank per pattern (``group_local_ranks``), weighted by the ranks of the node that share it.
    roles: Dict[Tuple, List] = {}
    by_role = cand.grad_reduce in ("bytegrad", "ring")
    for r in (range(rpn) if by_role else range(1)):
        plan_r = cand.sharding_plan().resolve(wl.dp, rpn, r)
        optim_local, replica_local = group_local_ranks(plan_r)
        role = (optim_local, replica_local) if cand.grad_reduce == "ring" else (optim_local == 0, replica_local == 0)
        roles.setdefault(role, [plan_r, 0])[1] += 1
    weights = [n for _, n in roles.values()] if by_role else [rpn]
    per_rank = [step_calls(cand, plan_r, buckets, wl.micro_batches, wl.wire()) for plan_r, _ in roles.values()]
    if len({len(c) for c in per_rank}) != 1:
        raise AssertionError("ranks of a node issue different call sequences")
    timed, ledger_inter, wire_inter, intra_max = [], 0, 0.0, 0
    cache: Dict[Tuple, Tuple[float, Tuple[str, ...], float, float]] = {}

    def per_rank_work(i: int, field: str, shared: bool) -> float:
        """Call ``i``'s work on one rank. Ranks sharing a node's processors (CPU) pool it: the node's mean; ranks
        with their own processors (GPU) wait for the busiest."""
        vals = [getattr(calls[i], field) for calls in per_rank]
        return sum(w * v for w, v in zip(weights, vals)) / sum(weights) if shared else max(vals)

    for i, c in enumerate(per_rank[0]):
        node_inter = sum(w * calls[i].inter for w, calls in zip(weights, per_rank))
        intra = max(calls[i].intra for calls in per_rank)
        intra_cpu = per_rank_work(i, "intra", profile.intra_on_compute)
        kernel_elems = per_rank_work(i, "kernel_elems", profile.kernels_on_compute)
        reduce_elems = per_rank_work(i, "reduce_elems", profile.kernels_on_compute)
        requant_elems = per_rank_work(i, "requant_elems", profile.kernels_on_compute)
        g = c.group
        op = c.op
        ledger_inter += node_inter
        if op == "reduce_scatter" and profile.reduce_scatter_as_all_reduce:
            # gloo sends and times an all-reduce of the whole bucket (see the profile's note): twice the bytes
            op, node_inter, intra, intra_cpu = "all_reduce", 2 * node_inter, 2 * intra, 2 * intra_cpu
        wire = float(node_inter)
        if profile.algorithm == "ring" and op in _RING_OPS and 1 < g.per_node < g.size:
            wire *= (g.size - 1) / (g.per_node * (g.size - g.per_node))
        wire_inter += wire
        intra_max += intra
        sig = (op, g, intra, intra_cpu, wire, kernel_elems, reduce_elems, requant_elems)
        if sig not in cache:
            t, links, t_intra = 0.0, [], 0.0
            if intra > 0:
                t = profile.link("intra", op).time(steps(op, g.per_node), intra)
                t_intra = t if intra_cpu == intra else profile.link("intra", op).time(steps(op, g.per_node),
                                                                                      intra_cpu)
                links.append("intra")
            if wire > 0:
                t = max(t, profile.link("inter", op).time(steps(op, g.size), wire))
                links.append("inter")
            if not links:       # nothing leaves the rank (e.g. a ByteGrad leader's reduce): latency only
                links.append("intra" if g.nodes == 1 else "inter")
                t = profile.link(links[0], op).alpha_s * steps(op, g.per_node if g.nodes == 1 else g.size)
            reduce_bps = profile.reduce_kernel_bytes_per_s or profile.kernel_bytes_per_s
            kernel_s = 4.0 * (kernel_elems / profile.kernel_bytes_per_s + reduce_elems / reduce_bps
                              + requant_elems / (profile.requant_kernel_bytes_per_s or reduce_bps))
            cache[sig] = (t, tuple(links), kernel_s, t_intra)
        t, links, kernel_s, t_intra = cache[sig]
        timed.append(_Timed(c, t, links, kernel_s, t_intra))
    return timed, ledger_inter, int(wire_inter), intra_max


class _Chain:
    """One backend work on the engine: its hops, the next one to issue, when the last issued one ends."""

    __slots__ = ("hops", "next", "end", "seq")

    def __init__(self, hops: Sequence[_Timed], end: float, seq: int = -1) -> None:
        self.hops, self.next, self.end, self.seq = list(hops), 0, end, seq   # seq: launch number on the engine


class _Replay:
    """The three timelines of the module note, and the progress engine's thread that issues every hop.

    The engine's rule (``comm/progress.py``): ``LAUNCH(k)`` issues k's first hop, then advances every older
    multi-hop work by one hop, each after its current hop has ended (the engine thread blocks on it);
    ``COMPLETE(k)`` (the training thread waits for k: a forward pre-hook, a full buffer pool, the step) issues
    every remaining hop of every work launched up to k in rounds, one hop per work and round -- on CPU (the engine's
    thread) the newer works' next hops too while k's have not all been issued; on CUDA (the inline engine) not. A
    chain therefore moves one hop per later launch or round and finishes at the next wait, not as soon as each hop
    could start.
    """

    def __init__(self, profile: HardwareProfile) -> None:
        self.profile = profile
        self.now = 0.0
        self.free = {"intra": 0.0, "inter": 0.0}
        self.engine = 0.0                       # the engine thread's clock
        self.inflight: List[_Chain] = []
        self.launched = 0
        self.advance_newer = profile.device == "cpu"   # the thread engine's rule (comm/progress.py)

    def _hop(self, h: _Timed, at: float) -> float:
        """Issue one hop on the engine at ``at``; returns when it ends. Its host work shares the processor."""
        p = self.profile
        # the training thread issues it (inline on CUDA) and, for a quantized hop, runs its codec calls' host side
        self.now += p.launch_s + p.hop_cpu_s + (p.codec_host_s if h.kernel_s > 0 else 0.0)
        dur = h.duration
        if p.kernels_on_compute:
            self.now += h.kernel_s
            at += h.kernel_s
        else:
            dur += h.kernel_s
        if p.intra_on_compute:
            self.now += h.intra_s
        start = max([at] + [self.free[l] for l in h.links])
        end = start + dur
        for l in h.links:
            self.free[l] = end
        return end

    def _advance(self, c: _Chain, e: float) -> float:
        e = max(e, c.end)
        c.end = self._hop(c.hops[c.next], e)
        c.next += 1
        return e

    def launch(self, hops: Sequence[_Timed]) -> _Chain:
        """``LAUNCH``: submitted now by the training thread."""
        c = _Chain(hops, self.now, self.launched)
        self.launched += 1
        if not c.hops:
            return c
        e = max(self.engine, self.now)
        c.end = self._hop(c.hops[0], e)
        c.next = 1
        for older in self.inflight:
            if older.next < len(older.hops):
                e = self._advance(older, e)
        self.engine = e
        self.inflight = [o for o in self.inflight if o.next < len(o.hops) or o.end > e] + [c]
        return c

    def direct(self, hops: Sequence[_Timed]) -> _Chain:
        """A weight gather: issued by the training thread itself (not on the engine), waited for with ``done``."""
        c = _Chain(hops, self.now)
        for h in c.hops:
            c.end = self._hop(h, max(self.now, c.end))
        c.next = len(c.hops)
        return c

    def done(self, c: _Chain) -> None:
        self.now = max(self.now, c.end)

    def complete(self, c: _Chain) -> None:
        """``COMPLETE``: the training thread waits for ``c``; the engine first finishes every work launched up to it
        -- by launch number, also when ``c`` itself already ended (the engine's rule)."""
        upto = [o for o in self.inflight if o.seq <= c.seq]
        newer = [o for o in self.inflight if o.seq > c.seq] if self.advance_newer else []
        if upto:
            e = max(self.engine, self.now)
            while any(o.next < len(o.hops) for o in upto):   # rounds: one hop each, the newer works too
                for o in upto + newer:
                    if o.next < len(o.hops):
                        e = self._advance(o, e)
            for older in upto:
                e = max(e, older.end)
            self.engine = e
            self.inflight = [o for o in self.inflight if o.seq > c.seq]
        self.now = max(self.now, c.end)


# Micro-batches replayed exactly; beyond, each further middle micro-batch adds what the last one did (they are alike).
EXACT_MICRO_BATCHES = 6


@dataclasses.dataclass(frozen=True)
class _Replayed:
    step_s: float
    busy_s: float              # the busier channel's time in the step
    ledger_inter: int
    wire_inter: int
    intra: int
    calls: int


def _replay(cand: Candidate, wl: Workload, profile: HardwareProfile, plan: ResolvedPlan,
            buckets: Sequence[BucketShape], data: Sequence[int], M: int) -> _Replayed:
    """Two steps of ``M`` micro-batches on the timelines of the module note; the second one's time and traffic."""
    wl_m = dataclasses.replace(wl, micro_batches=M)
    timed, ledger_inter, wire_inter, intra = _time_calls(cand, wl_m, profile, buckets)
    chains: Dict[Tuple, List[_Timed]] = {}
    for t in timed:
        chains.setdefault(t.call.key, []).append(t)
    for v in chains.values():
        v.sort(key=lambda t: t.call.hop)
    K = len(buckets)
    per_micro = _per_micro_s(wl, profile)
    fwd = per_micro / 3.0
    grad_copy = sum(data) * profile.grad_s_per_element
    bwd = per_micro * 2.0 / 3.0 + fwd * wl.recomputed_fraction + grad_copy
    share = [d / sum(data) for d in data]
    fwd_order = list(reversed(range(K)))
    tail = _optimizer_s(wl, profile, buckets) + _scalar_s(wl, profile) + (wl.pp - 1) * per_micro
    zero3 = plan.param > 1
    pool = max(1, wl.setup.gather_pool_size)
    # Pooled gradient buffers (buffer alternation): bucket k's first gradient takes a buffer, so backward waits
    # there for the reduction ``replayed_pool_buffers`` launches back (grad_sync.py; none with local accumulation).
    buffers = (max(1, wl.setup.replayed_pool_buffers(plan, cand.grad_reduce))
               if not plan.accumulates_locally(M > 1) else None)
    reducing = {key[2] for key in chains if key[0] == "rs"}

    rp = _Replay(profile)
    gathered: Dict[int, _Chain] = {}
    step_ends = []
    for _ in range(2):
        pending: List[_Chain] = []
        for m in range(M):
            if not zero3 and (m > 0 or not gathered) and m not in reducing:
                rp.now += fwd + bwd      # neither waits for a gather nor reduces: compute only
                continue
            if zero3:
                issued: Dict[int, _Chain] = {}
                for i, k in enumerate(fwd_order):
                    for j in fwd_order[i:i + pool]:
                        if j not in issued:
                            issued[j] = rp.direct(chains.get(("fg", j, m), []))
                    rp.done(issued[k])
                    rp.now += fwd * share[k]
            else:
                for k in fwd_order:
                    if m == 0 and k in gathered:
                        rp.done(gathered[k])
                    rp.now += fwd * share[k]
            issued_b: Dict[int, _Chain] = {}
            for k in range(K):
                if zero3:
                    for j in range(k, min(K, k + pool)):
                        if j not in issued_b:
                            issued_b[j] = rp.direct(chains.get(("bg", j, m), []))
                    rp.done(issued_b[k])
                if buffers is not None and ("rs", k, m) in chains and len(pending) >= buffers:
                    rp.complete(pending[-buffers])
                rp.now += bwd * share[k]
                if ("rs", k, m) in chains:
                    pending.append(rp.launch(chains[("rs", k, m)]))
        for c in pending:
            rp.complete(c)
        rp.now += tail
        step_ends.append(rp.now)
        if not zero3:
            gathered = {k: rp.direct(chains.get(("ag", k), [])) for k in fwd_order}
    busy = max(sum(t.duration for t in timed if link in t.links) for link in ("intra", "inter"))
    return _Replayed(step_ends[1] - step_ends[0], busy, ledger_inter, wire_inter, intra, len(timed))


def _per_micro_s(wl: Workload, profile: HardwareProfile) -> float:
    return (wl.spec.flops_per_sequence() * wl.micro_batch / (wl.tp * wl.pp)
            / profile.compute_for(wl.spec.num_layers, wl.spec.hidden_size))


def _optimizer_s(wl: Workload, profile: HardwareProfile, buckets: Sequence[BucketShape]) -> float:
    return sum(b.shard_numel for b in buckets) * profile.optimizer_s_per_element


def _scalar_s(wl: Workload, profile: HardwareProfile) -> float:
    """The step's scalar all-reduces over DP (inf flag, norm): latency only, a tree over the DP group."""
    link = "inter" if wl.dp > wl.ranks_per_node else "intra"
    return 2 * profile.link(link, "all_reduce").alpha_s * 2 * math.ceil(math.log2(max(2, wl.dp)))


def predict(cand: Candidate, wl: Workload, profile: HardwareProfile) -> Prediction:
    """Predicted step time, exposed communication, memory and traffic of ``cand`` (see the module note)."""
    plan = cand.sharding_plan().resolve(wl.dp, wl.ranks_per_node, 0)
    buckets, data = bucket_shapes(wl.spec.busiest_stage_numels(wl.tp, wl.pp), cand, plan, wl.setup)
    M = wl.micro_batches
    if M <= EXACT_MICRO_BATCHES:
        r = _replay(cand, wl, profile, plan, buckets, data, M)
    else:   # the middle micro-batches are alike: extrapolate the last exact one's increment
        a = _replay(cand, wl, profile, plan, buckets, data, EXACT_MICRO_BATCHES - 1)
        b = _replay(cand, wl, profile, plan, buckets, data, EXACT_MICRO_BATCHES)
        x = M - EXACT_MICRO_BATCHES
        r = _Replayed(*(vb + x * (vb - va) for va, vb in zip(dataclasses.astuple(a), dataclasses.astuple(b))))
    per_micro = _per_micro_s(wl, profile)
    grad_copy = sum(data) * profile.grad_s_per_element
    recompute = per_micro / 3.0 * wl.recomputed_fraction
    compute_s = (M * (per_micro + recompute + grad_copy) + _optimizer_s(wl, profile, buckets)
                 + (wl.pp - 1) * per_micro)
    step_s = r.step_s + profile.overlap_slowdown * min(r.busy_s, M * per_micro)
    flops_gpu = wl.spec.flops_per_sequence() * wl.micro_batch * M / (wl.tp * wl.pp)

    states = model_state_memory(cand, plan, buckets, data, wl.setup, M, deferred_numel=wl.deferred_numel)
    model_states = sum(states.values())
    activations = wl.spec.activation_bytes(wl.micro_batch, tp=wl.tp, pp=wl.pp, micro_batches=M,
                                           recompute=wl.recompute, recompute_method=wl.recompute_method,
                                           recompute_num_layers=wl.recompute_num_layers,
                                           sequence_parallel=wl.sequence_parallel,
                                           stores_attention_scores=profile.stores_attention_scores)
    transient = transient_memory(plan, buckets, wl.setup)
    memory = {"model_states": model_states, "activations": activations, "transient": transient,
              "total": model_states + activations + transient, **{f"state_{k}": v for k, v in states.items()}}
    return Prediction(cand, step_s, compute_s, max(0.0, step_s - compute_s), memory, int(r.ledger_inter),
                      int(r.wire_inter), int(r.intra), int(r.calls), flops_gpu)
