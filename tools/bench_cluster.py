#!/usr/bin/env python
"""Step time of the communication backends on an emulated multi-node cluster (network namespaces + tbf).

``tools/netns_cluster.sh`` builds one network namespace per node, joined through a switch namespace by veth pairs
rate-limited with ``tbf`` (e.g. 1 Gbit/s); the ranks of one node run inside that node's namespace and talk to each
other over its loopback, so only cross-node traffic pays the emulated link. The namespaces are always removed at
the end (also on errors and Ctrl-C). Needs root; nothing is changed on the host's own interfaces.

Modes:
  raw  -- one ZeRO-2 step's collectives: ``--buckets`` buckets of ``--bucket-numel`` elements reduce-scattered
          (all launched, then waited, as the ODO does during backward) and then all-gathered, per backend combo.
  gpt  -- a small megatron-core GPT trained with the ODO (``megatron_ext.OverlappedDDP`` +
          ``OverlappedDistributedOptimizer``), one combo after the other; step time = forward + backward + step.

Combos: plain, ring (plain's reduction as NCCL's ring: on gloo plain's reduce-scatter is an all-reduce), qwZ,
qwZ+ring, qgZ (INT4), qwZ+qgZ, ByteGrad, and DeepSpeed ZeRO-2 as the peer (gpt mode, only when
``deepspeed`` imports; skipped with a message otherwise). Each combo is timed at every ``--rates`` link rate; the
table shows milliseconds per step (max over ranks, median over iterations) and the speedup over plain, next to
seed 000's low-bandwidth results (1 IB link, 384 V100: 1.79x-2.16x end to end).

Sharding plans (gpt mode, ``--plans zero2,zero1,mics,amsp7b``): every combo runs under every plan (ZeRO-2 and
ZeRO-1 over the whole DP group, MiCS/HSDP-like node-local gradients and optimizer states, AMSP's 7B plan with
node-local optimizer states and full gradients), with ``--micro-batches`` micro-batches per step; the peers add
FSDP2 HSDP (2-D mesh: sharded inside a node, replicated across nodes, ``--peers fsdp2-hsdp``) and DeepSpeed
ZeRO-2. Every row also reports the bytes that actually left each node (the node namespace's eth0 counter, so
peers are measured the same way as the ODO, TCP/IP headers included) and the model-state MB per rank.

Honest comparison (gpt mode, issue 14): ``--sweep 4000000,1000000,400000`` runs every combo at each bucket size too,
``--floor`` adds the ``unlimited`` link to the rates (the no-link floor), and the summary reports, per rate, each row at
its best bucket size next to its limit ``max(no-link step, cross-node bytes per node / link rate)`` and the
best-against-best speedup over plain, and next to its phase limit (:func:`phase_limit`: the gathers hidden only behind
the forward, the reductions only behind the backward, from the phase times and split link bytes every ODO row
records; ``--rescore JSON`` recomputes a stored run's summary; each row is measured at every rate back to back in one
set of ranks, so its floor and its rated steps see the same spell of a shared host -- ``--rate-order pass`` runs a
pass over every row per rate instead); ``--peers fsdp2,deepspeed-zero2`` adds FSDP2
(ZeRO-2-like: ``reshard_after_forward=False``) and DeepSpeed ZeRO-2; ``--peers compute`` adds the floor under every
row: the same ranks computing alone (forward, backward, clipping and Adam over 1/DP of the parameters, nothing sent).
``--progress-engine both`` adds each combo without the progress engine (row ``<combo> (sync)``), for comparison.
Where the link idles (gpt mode, rated links): per phase of an ODO row -- forward, backward, ``sync`` (the
reductions still in flight after the backward), update, other -- its ms, the MB its node sent and the share of
the phase the link was busy (``wire_phases`` in the JSON; :func:`link_phases`); ``--link-timeline`` adds, per row, node
0's link busy share in 25 ms windows through the row's last timed step, beside where its phases ended.

    sudo python tools/bench_cluster.py --nodes 2 --ranks-per-node 2 --rates 1gbit,100mbit --json bench_cluster.json
    sudo python tools/bench_cluster.py --mode gpt --plans zero2,zero1,mics,amsp7b --micro-batches 4 \
        --peers fsdp2-hsdp,deepspeed-zero2 --rates 1gbit,100mbit
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HELPER = os.path.join(HERE, "netns_cluster.sh")

sys.path.insert(0, ROOT)
from megatron_ext.comm.combos import select_combos  # noqa: E402

COMBOS = select_combos(["plain", "ring", "qwZ", "qwZ+ring", "qgZ INT4", "qwZ+qgZ INT4", "ByteGrad"])
# Rows that send weights and gradients at full precision: the baselines the quantized rows are compared with.
LOSSLESS_BASELINES = ("plain", "ring")
SEED_000_LOW_BW = ("seed 000 Table 2, 384 V100, 1 IB link (100 Gbit/s): ZeRO++ over ZeRO-3 end to end 1.79x-2.16x; "
                   "8 IB links: 1.13x-1.30x")


# ------------------------------------------------------------------------------------------------------------------
# worker side (runs inside a node namespace)
# ------------------------------------------------------------------------------------------------------------------
def _timed(fn, iters: int, warmup: int) -> List[float]:
    import torch.distributed as dist

    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return times


def _timed_continuous(step, flush, iters: int, warmup: int) -> List[float]:
    """Mean step time over ``iters`` back-to-back steps (the ODO's param all-gather of step i overlaps the forward
    of step i+1, so a barrier between steps would hide it); ``flush`` completes the last step's communication."""
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    flush()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    flush()
    return [(time.perf_counter() - t0) / iters]


PLAN_PRESETS = {
    "zero2": lambda rpn: _plan().zero2(),
    "zero1": lambda rpn: _plan().zero1(),
    "mics": lambda rpn: _plan().mics(rpn),
    "amsp7b": lambda rpn: _plan().amsp_7b(rpn),
    "zero3": lambda rpn: _plan().zero3(),
    "zero3hpz": lambda rpn: _plan().zero3(hpz=rpn),
}


def _plan():
    from megatron_ext import ShardingPlan
    return ShardingPlan


def _wire_tx_bytes() -> int:
    """Bytes sent on this node namespace's link (0 outside the emulated cluster): cross-node traffic only, since
    the ranks of a node talk over its loopback."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def _per_node(topo, sent: List[float]) -> List[float]:
    """Link byte counts read by every rank, as the mean over nodes of what each node's local rank 0 read (the ranks
    of a node share its link and its counter)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x) if topo.local_rank == 0 else 0.0 for x in sent], dtype=torch.float64)
    dist.all_reduce(t)
    return [v / topo.num_nodes for v in t.tolist()]


def _wire_per_node_per_step(topo, before: int, steps: int) -> float:
    """Cross-node bytes per node per step from the eth0 counters."""
    return _per_node(topo, [_wire_tx_bytes() - before])[0] / max(1, steps)


def _timed_steps(topo, step, flush, a) -> Dict:
    """Back-to-back step time (max over ranks), CPU seconds per step (every thread of every rank: on a host with
    fewer cores than busy threads this, not the wall time, is what a backend's own work costs, and it is far less
    noisy) and the wire bytes per node per step of the timed steps; for an :class:`OdoStep`, also its mean phase
    times (max over ranks)."""
    import torch.distributed as dist

    for _ in range(a.warmup):
        step()
    flush()
    dist.barrier()
    before = _wire_tx_bytes()
    if hasattr(step, "reset_phases"):
        step.reset_phases()
    cpu0 = time.process_time()
    times = _over_ranks(_timed_continuous(step, flush, a.iters, 0))
    cpu = _over_ranks([(time.process_time() - cpu0) / a.iters], op="SUM")[0]
    out = {"times_s": times, "cpu_s": [cpu], "wire_per_node": _wire_per_node_per_step(topo, before, a.iters)}
    if hasattr(step, "mean_phases"):
        phases = step.mean_phases()
        out["phases_s"] = {k: [v] for k, v in zip(phases, _over_ranks(list(phases.values())))}
        out["wire_phases"] = {k: [v] for k, v in _wire_phases_per_node(topo, step).items()}
    if getattr(step, "timeline", None) is not None:
        out["link_timeline"] = step.timeline   # rank 0's: node 0's link in the last timed step
    return out


def _wire_phases_per_node(topo, step: "OdoStep") -> Dict[str, float]:
    """Cross-node bytes per node per step sent in each phase of :class:`OdoStep` (the phases are local rank 0's,
    which the other ranks' match to within their skew)."""
    sent = _per_node(topo, [step.phase_wire[k] for k in PHASES])
    return {k: v / max(1, step.steps) for k, v in zip(PHASES, sent)}


def _wire_split(topo, step: OdoStep, flush) -> Dict[str, float]:
    """Cross-node bytes per node of one step, split at the point between the gradient reductions and the weight
    gathers: ``reduce`` = forward + backward + gradient sync (the last step's gathers flushed before, so forward
    sends nothing), ``gather`` = the optimizer step and its gathers, flushed."""
    import torch.distributed as dist

    flush()
    dist.barrier()
    c0 = _wire_tx_bytes()
    step.fwd_bwd()
    dist.barrier()
    c1 = _wire_tx_bytes()
    step.update()
    flush()
    dist.barrier()
    c2 = _wire_tx_bytes()
    reduce, gather = _per_node(topo, [c1 - c0, c2 - c1])
    return {"reduce": reduce, "gather": gather}


def _over_ranks(times: List[float], op: str = "MAX") -> List[float]:
    """Each value reduced over the ranks (``op``: a ``dist.ReduceOp`` name; MAX for times, SUM for CPU seconds)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


def _ledger_over_ranks(ledger, topo) -> Dict:
    """This rank's ledger summary plus the group's cross-node bytes per node (sum over ranks / nodes)."""
    import torch
    import torch.distributed as dist

    summ = ledger.summary()
    t = torch.tensor([summ["total"]["intra"], summ["total"]["inter"]], dtype=torch.float64)
    dist.all_reduce(t)
    summ["per_node"] = {"intra": t[0].item() / topo.num_nodes, "inter": t[1].item() / topo.num_nodes}
    return summ


def _raw_combo(topo, label, gr, pg, extra, a) -> Dict:
    import torch

    from megatron_ext.comm import BackendOptions, CommLedger, build_grad_reduce, build_param_gather

    dtype = getattr(torch, a.dtype)
    opts = BackendOptions(quant_group_size=a.group_size, qgz_pipeline_stages=a.stages or 2, **extra)
    ledger = CommLedger()
    grad_be = build_grad_reduce(gr, topo, ledger, opts)
    param_be = build_param_gather(pg, topo, ledger, opts)
    P = topo.size
    n = -(-a.bucket_numel // (P * 64)) * 64
    g = torch.Generator().manual_seed(topo.rank)
    buckets = [torch.randn(P * n, generator=g).to(dtype) for _ in range(a.buckets)]
    shards = [torch.empty(n, dtype=dtype) for _ in range(a.buckets)]

    def step():
        works = [grad_be.reduce_scatter(b, s) for b, s in zip(buckets, shards)]
        for w in works:
            w.wait()
        works = [param_be.all_gather(s, b) for b, s in zip(buckets, shards)]
        for w in works:
            w.wait()

    ledger.enabled = False
    times = _over_ranks(_timed(step, a.iters, a.warmup))
    ledger.enabled = True
    ledger.reset()
    step()
    return {"times_s": times, "ledger": _ledger_over_ranks(ledger, topo)}


def _init_model_parallel() -> None:
    """megatron-core's parallel state (TP = PP = 1), which build_gpt_model needs; once per process."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_ext.compat import enable_cpu_compat
        enable_cpu_compat()
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _gpt_setup(a, rank: int):
    import torch

    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch

    _init_model_parallel()
    torch.manual_seed(1234)
    model = build_gpt_model(a.layers, a.hidden, a.heads, a.vocab, a.seq)
    batches = [synthetic_gpt_batch(a.micro_batch, a.seq, a.vocab, seed=1000 * rank + i) for i in range(a.micro_batches)]
    return model, batches


def _gpt_loss(model, batch):
    from megatron_ext.models import gpt_loss_func

    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return gpt_loss_func(batch["loss_mask"], out)[0]


def _gpt_combo(topo, label, gr, pg, extra, a, plan_name: str = "zero2", bucket: Optional[int] = None,
               engine: bool = True, speculative: bool = False) -> Dict:
    """``bucket``: elements per bucket (default ``--bucket-numel``); ``engine``: the progress engine on or off;
    ``speculative``: the speculative step (optimizer/speculative_step.py)."""
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx

    model, batches = _gpt_setup(a, topo.rank)
    ocfg = mx.OverlapConfig(bucket_size=bucket or a.bucket_numel, grad_reduce=gr, param_gather=pg,
                            progress_engine=engine,
                            ranks_per_node=topo.ranks_per_node, grad_reduce_in_fp32=False,
                            quant_group_size=a.group_size, qgz_pipeline_stages=a.stages or None,
                            qgz_bits=extra.get("qgz_bits", 4), sharding=PLAN_PRESETS[plan_name](topo.ranks_per_node),
                            speculative_step=speculative)
    ddp = mx.OverlappedDDP(model, ocfg)
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=False,
                                                            clip_grad=a.clip_grad), ddp)
    step = odo_step(ddp, opt, batches)
    step.sample_link = a.link_timeline and topo.rank == 0

    ddp.ledger.enabled = False
    # Flushing completes the communication in flight (ZeRO-3's force_param_sync would gather every weight).
    out = _timed_steps(topo, step, ddp.param_sync.wait_all, a)
    out["wire_split"] = _wire_split(topo, step, ddp.param_sync.wait_all)
    step()   # steady state again before the step whose bytes the ledger counts
    ddp.ledger.enabled = True
    ddp.ledger.reset()
    step()
    mem = ddp.memory_report()
    rounds = {"committed": sum(x.committed for x in opt.speculation),
              "rolled_back": sum(x.rolled_back for x in opt.speculation),
              "in_backward": sum(x.in_backward for x in opt.speculation)} if speculative else None
    return {**out, "ledger": _ledger_over_ranks(ddp.ledger, topo), "plan": ddp.plan.describe(),
            "speculative_rounds": rounds,
            "bucket_numel": bucket or a.bucket_numel, "buckets": len(ddp.buckets), "progress_engine": engine,
            "buffer_pool_size": ddp.buffer_pool_size, "params": sum(p.numel() for p in model.parameters()),
            "model_state_bytes": sum(v for k, v in mem.items() if k not in ("bucket_pool", "gather_pool")),
            "memory": mem}


PHASES = ("forward", "backward", "sync", "update")


class OdoStep:
    """One ODO training step over ``batches`` (megatron's no_sync pattern: the last micro-batch synchronises), in two
    halves so the bench can read the link counters between them, summing the time of the phases a link transfer can
    hide behind: ``forward`` (the first micro-batch's, where the weight gathers are consumed), ``backward`` (the last
    micro-batch's, which the gradient reductions overlap), ``sync`` (``finish_grad_sync``: the reductions still in
    flight after the backward) and ``update`` (``opt.step``: clipping norm, Adam, the gathers' launch); and the
    bytes this rank's node sent on its link in each (``wire_phases``: where the link idles)."""

    sample_link = False    # --link-timeline: sample the link during each step, keep the last step's timeline
    timeline: Optional[Dict] = None

    def __init__(self, ddp, opt, batches) -> None:
        self.ddp, self.opt, self.batches = ddp, opt, batches
        self.reset_phases()

    def reset_phases(self) -> None:
        self.marks: Dict[str, float] = {}
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.phase_wire = dict.fromkeys(PHASES, 0)
        self.steps = 0

    def _mark(self, phase: str, t0: float, w0: int) -> Tuple[float, int]:
        """Charge the time and link bytes since ``(t0, w0)`` to ``phase``; the new mark."""
        t, w = time.perf_counter(), _wire_tx_bytes()
        self.phase_s[phase] += t - t0
        self.phase_wire[phase] += w - w0
        self.marks[phase + "_end"] = t
        return t, w

    def mean_phases(self) -> Dict[str, float]:
        return {k: v / max(1, self.steps) for k, v in self.phase_s.items()}

    def fwd_bwd(self) -> None:
        import contextlib

        M = len(self.batches)
        for i, batch in enumerate(self.batches):
            mark = time.perf_counter(), _wire_tx_bytes()
            with self.ddp.no_sync() if i < M - 1 else contextlib.nullcontext():
                loss = self.opt.scale_loss(_gpt_loss(self.ddp, batch) / M)
                if i == 0:
                    mark = self._mark("forward", *mark)
                elif i == M - 1:   # the last micro-batch's backward starts here, after its own forward
                    mark = time.perf_counter(), _wire_tx_bytes()
                loss.backward()
            if i == M - 1:
                mark = self._mark("backward", *mark)
        self.ddp.finish_grad_sync()
        self._mark("sync", *mark)

    def update(self) -> None:
        mark = time.perf_counter(), _wire_tx_bytes()
        self.opt.step()
        self._mark("update", *mark)
        self.opt.zero_grad()

    def __call__(self) -> None:
        sampler = _LinkSampler() if self.sample_link else None
        self.fwd_bwd()
        self.update()
        self.steps += 1
        if sampler is not None:
            self.timeline = sampler.finish(self.marks)


TIMELINE_SAMPLE_S = 0.002    # --link-timeline: how often the sampler reads the link counter
TIMELINE_WINDOW_S = 0.025    # ... and the windows it reports


class _LinkSampler:
    """``--link-timeline``: reads this node's link counter every ``TIMELINE_SAMPLE_S`` on a thread during one step,
    then reports the bytes sent in each ``TIMELINE_WINDOW_S`` window from the step's start (a diagnostic: the
    thread takes a little CPU from the step it watches)."""

    def __init__(self) -> None:
        import threading

        self.samples: List[Tuple[float, int]] = [self._sample()]
        self.t0 = self.samples[0][0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _sample() -> Tuple[float, int]:
        t0 = time.perf_counter()
        b = _wire_tx_bytes()
        return (t0 + time.perf_counter()) / 2, b   # the counter read takes time of its own: its middle

    def _run(self) -> None:
        while not self._stop.wait(TIMELINE_SAMPLE_S):
            self.samples.append(self._sample())

    def finish(self, marks: Dict[str, float]) -> Dict:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._sample())
        return {"marks_ms": {k: 1e3 * (v - self.t0) for k, v in marks.items() if v >= self.t0},
                "window_ms": 1e3 * TIMELINE_WINDOW_S,
                "bytes_per_s": link_windows(self.samples, self.t0, TIMELINE_WINDOW_S)}


def link_windows(samples: List[Tuple[float, int]], t0: float, window_s: float) -> List[List[float]]:
    """``[ms from t0, bytes/s]`` per window of ``window_s`` from counter samples ``(time, bytes)``: the rate
    between the first and last sample inside the window (windows with fewer than two samples are left out)."""
    windows: List[List[float]] = []
    start = t0
    while start < samples[-1][0]:
        end = start + window_s
        inside = [sm for sm in samples if start <= sm[0] <= end]
        if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
            rate = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
            windows.append([1e3 * (start - t0), rate])
        start = end
    return windows


def odo_step(ddp, opt, batches) -> OdoStep:
    """One ODO training step over ``batches`` as a callable (see :class:`OdoStep`)."""
    return OdoStep(ddp, opt, batches)


def _fsdp2_combo(topo, a, hsdp: bool, reshard) -> Dict:
    """FSDP2 ``fully_shard`` per decoder layer and at the root. ``hsdp``: a (nodes x ranks-per-node) mesh, sharded
    inside a node and replicated across nodes; otherwise one mesh over all ranks. ``reshard`` is
    ``reshard_after_forward``: False keeps the weights gathered between forward and backward (the ODO's plans with
    full parameters), True is ZeRO-3, an int re-gathers the backward inside groups of that many ranks (hpZ-like)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, batches = _gpt_setup(a, topo.rank)
    if hsdp:
        mesh = init_device_mesh("cpu", (topo.num_nodes, topo.ranks_per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (topo.size,))
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    M = len(batches)

    def step():
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == M - 1)
            (_gpt_loss(model, batch) / M).backward()
        opt.step()
        opt.zero_grad()

    out = _timed_steps(topo, step, lambda: None, a)
    def local_bytes(t) -> int:   # FSDP2's parameters and Adam states are DTensors: count this rank's shard
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    local = sum(local_bytes(p) for p in model.parameters())
    states = sum(local_bytes(v) for st in opt.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0)
    return {**out, "model_state_bytes": 2 * local + states, "ledger": None,
            "note": "FSDP2 is not instrumented by the ledger; model state = local parameter and gradient shards "
                    "+ Adam states"}


class _NoComm:
    """Stands in for the DDP wrapper and the optimizer in :class:`OdoStep` when nothing is communicated: the step
    clips this rank's share of the gradients (its own norm, ``clip``: the ODO rows' ``--clip-grad``) and updates it."""

    def __init__(self, model, opt, clip: float) -> None:
        self.model, self.opt, self.clip = model, opt, clip

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        pass

    def scale_loss(self, loss):
        return loss

    def step(self) -> None:
        if self.clip > 0:
            import torch
            torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], self.clip)
        self.opt.step()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)   # every gradient, as the ODO's buffers are zeroed every step


def owned_share(params: List, rank: int, size: int) -> List:
    """The whole parameters whose first element falls in ``rank``'s 1/``size`` of the flattened parameters: every
    parameter in exactly one rank's share, about 1/size of the elements in each."""
    total = sum(p.numel() for p in params)
    lo, hi = rank * total // size, (rank + 1) * total // size
    owned, start = [], 0
    for p in params:
        if lo <= start < hi:
            owned.append(p)
        start += p.numel()
    return owned


def _compute_combo(topo, a) -> Dict:
    """The floor no distributed row can beat on this host: every rank runs forward and backward on its micro-batches
    and clips and updates its 1/DP share of the parameters (what a sharded optimizer updates), and sends nothing. On
    a host with fewer cores than ranks its step is the compute the ranks share; a row's step above it is what
    communication costs there (the link, the backends' own work, the threads that run them)."""
    import torch

    model, batches = _gpt_setup(a, topo.rank)
    opt = torch.optim.Adam(owned_share(list(model.parameters()), topo.rank, topo.size), lr=1e-4)
    nocomm = _NoComm(model, opt, a.clip_grad)
    out = _timed_steps(topo, odo_step(nocomm, nocomm, batches), lambda: None, a)
    return {**out, "ledger": None, "model_state_bytes": None,
            "note": "no communication: forward, backward, clipping and Adam over 1/DP of the parameters"}


def _deepspeed_combo(topo, a, stage: int = 2, hpz: int = 1) -> Dict:
    """DeepSpeed ZeRO-2 or ZeRO-3 (``hpz > 1``: ``zero_hpz_partition_size``), plain fp32 collectives, its own
    bucketing, on the same GPT and batches."""
    import deepspeed
    import torch

    # DeepSpeed compiles a small C++ op on first use: into a writable cache shared by the ranks (the orchestrator
    # sets it; torch's cpp_extension serialises concurrent builds with a lock file).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    os.environ.setdefault("LOCAL_RANK", str(topo.local_rank))
    os.environ.setdefault("RANK", str(topo.rank))
    os.environ.setdefault("WORLD_SIZE", str(topo.size))
    model, batches = _gpt_setup(a, topo.rank)
    M = len(batches)
    ds_config = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": M,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": a.bucket_numel,
                              "allgather_bucket_size": a.bucket_numel, "overlap_comm": False,
                              "contiguous_gradients": True},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        zo = ds_config["zero_optimization"]
        zo.pop("allgather_bucket_size")
        zo["stage3_prefetch_bucket_size"] = a.bucket_numel
        if hpz > 1:
            zo["zero_hpz_partition_size"] = hpz
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config,
                                      dist_init_required=False)

    def step():
        for batch in batches:
            engine.backward(_gpt_loss(engine, batch))
            engine.step()

    out = _timed_steps(topo, step, lambda: None, a)
    return {**out, "ledger": None, "model_state_bytes": _deepspeed_model_state_bytes(engine),
            "note": "DeepSpeed is not instrumented by the ledger"}


def _deepspeed_model_state_bytes(engine) -> Optional[int]:
    """This rank's model state as DeepSpeed holds it: parameters (ZeRO-3: the partitions ``ds_tensor`` and hpZ's
    ``ds_secondary_tensor``; ZeRO-2: the full module), fp32 partitions and Adam states."""
    import torch

    def nbytes(t) -> int:
        return t.numel() * t.element_size() if torch.is_tensor(t) else 0

    zopt = engine.optimizer
    params = list(engine.module.parameters())
    if hasattr(params[0], "ds_tensor"):
        held = sum(nbytes(p.ds_tensor) + nbytes(getattr(p, "ds_secondary_tensor", None)) for p in params)
        fp32 = sum(nbytes(t) for t in getattr(zopt, "fp32_partitioned_groups_flat", []))
    else:
        held = sum(nbytes(p) for p in params)
        fp32 = sum(nbytes(t) for t in getattr(zopt, "single_partition_of_fp32_groups", []))
    inner = getattr(zopt, "optimizer", zopt)
    states = sum(nbytes(v) for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return held + fp32 + states or None


PEERS = {
    "compute": ("compute only", _compute_combo),
    "fsdp2": ("FSDP2", lambda topo, a: _fsdp2_combo(topo, a, False, False)),
    "fsdp2-hsdp": ("FSDP2 HSDP", lambda topo, a: _fsdp2_combo(topo, a, True, False)),
    "fsdp2-zero3": ("FSDP2 reshard=True", lambda topo, a: _fsdp2_combo(topo, a, False, True)),
    "fsdp2-hpz": ("FSDP2 reshard=rpn", lambda topo, a: _fsdp2_combo(topo, a, False, topo.ranks_per_node)),
    "deepspeed-zero2": ("DeepSpeed ZeRO-2", lambda topo, a: _deepspeed_combo(topo, a)),
    "deepspeed-zero3": ("DeepSpeed ZeRO-3", lambda topo, a: _deepspeed_combo(topo, a, 3)),
    "deepspeed-zero3-hpz": ("DeepSpeed ZeRO-3+hpZ", lambda topo, a: _deepspeed_combo(topo, a, 3, topo.ranks_per_node)),
}


def default_extensions_dir() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_ext", "torch_extensions")


def _add(store: Dict, key: str, r: Dict) -> Dict:
    """Keep ``r`` under ``key``, or add its times (CPU and phase times too) to the earlier repeats' (their median is
    what is reported)."""
    if key not in store:
        store[key] = {**r, "times_s": []}
        store[key].pop("cpu_s", None)
        store[key].pop("phases_s", None)
        store[key].pop("wire_phases", None)
    row = store[key]
    row["times_s"] += r["times_s"]
    if r.get("link_timeline"):
        row["link_timeline"] = r["link_timeline"]   # the latest round's
    if r.get("speculative_rounds") and row.get("speculative_rounds") is not r["speculative_rounds"]:
        row["speculative_rounds"] = {k: row["speculative_rounds"].get(k, 0) + v
                                     for k, v in r["speculative_rounds"].items()}
    if r.get("cpu_s"):
        row.setdefault("cpu_s", []).extend(r["cpu_s"])
    for field in ("phases_s", "wire_phases"):
        for k, v in (r.get(field) or {}).items():
            row.setdefault(field, {}).setdefault(k, []).extend(v)
    return row


class RateSwitch:
    """The link rates a worker measures each row at. One rate (``--rate-order pass``): the orchestrator shaped the
    links before the ranks started. Several (the default, ``interleave``): every row is measured at each rate in
    turn, rank 0 re-shaping the links and every rank waiting at a barrier before the row runs, so a row's no-link
    floor and its rated steps fall in the same spell of the host instead of minutes apart. Each round
    (``--repeats``) goes through the rates in the opposite order of the one before, so no rate always runs first
    after a row is built."""

    def __init__(self, rates: List[str], nodes: int, prefix: str, rank: int, barrier) -> None:
        self.rates, self.nodes, self.prefix, self.rank, self.barrier = rates, nodes, prefix, rank, barrier
        self.order = list(rates)

    def next_round(self) -> None:
        self.order.reverse()

    def each(self):
        for rate in self.order:
            if len(self.rates) > 1:
                if self.rank == 0:
                    set_link_rate(self.nodes, rate, self.prefix)
                self.barrier()
            yield rate

    def tag(self, rate: str) -> str:
        """What the progress lines print before a row (the rate, when it changes between rows)."""
        return f"{rate:>10} " if len(self.rates) > 1 else ""


def _measure_rows(topo, a, plans, engines, sizes, switch: RateSwitch, results: Dict, sweep: Dict) -> None:
    """One round over every row (and sweep point); ``--repeats`` rounds interleave the rows, so a slow spell of the
    machine is spread over all of them instead of falling on one. ``results`` and ``sweep``: per rate of
    ``switch``."""
    specs = {"off": [False], "on": [True], "both": [False, True]}[a.speculative_step] if a.mode == "gpt" else [False]
    for plan_name in plans:
        for combo in COMBOS:
            label = combo.label
            if a.combos and label not in a.combos.split(","):
                continue
            extra = {"qgz_bits": combo.qgz_bits}
            for spec in specs:
                base_row = (label if len(plans) == 1 else f"{plan_name} {label}") + (SPEC_SUFFIX if spec else "")
                for engine in engines:
                    row = base_row + ("" if engine or len(engines) == 1 else SYNC_SUFFIX)
                    for rate in switch.each():
                        if a.mode == "raw":
                            r = _raw_combo(topo, label, combo.grad_reduce, combo.param_gather, extra, a)
                        else:
                            r = _gpt_combo(topo, label, combo.grad_reduce, combo.param_gather, extra, a, plan_name,
                                           engine=engine, speculative=spec)
                        _add(results.setdefault(rate, {}), row, r)
                        if a.rank == 0:
                            print(f"  {switch.tag(rate)}{row:<22} {1e3 * statistics.median(r['times_s']):9.1f} "
                                  "ms/step" + (f" (rounds {r['speculative_rounds']})" if spec else ""), flush=True)
                # The sweep: the same row at every other bucket size (progress engine as the first setting).
                for size in sizes:
                    key = str(size)
                    if size == a.bucket_numel:
                        for rate in switch.rates:   # all repeats so far: the point is replaced, not added to
                            r = results[rate][base_row]
                            sweep.setdefault(rate, {}).setdefault(base_row, {})[key] = _sweep_point(_add({}, key, r))
                        continue
                    for rate in switch.each():
                        r = _gpt_combo(topo, label, combo.grad_reduce, combo.param_gather, extra, a, plan_name,
                                       bucket=size, engine=engines[0], speculative=spec)
                        point = _add(sweep.setdefault(rate, {}).setdefault(base_row, {}), key, _sweep_point(r))
                        if a.rank == 0:
                            print(f"  {switch.tag(rate)}{base_row + ' @' + key:<22} "
                                  f"{1e3 * statistics.median(r['times_s']):9.1f} ms/step ({point['buckets']} buckets)",
                                  flush=True)


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=900))
    import logging
    logging.basicConfig(level=logging.ERROR)
    from megatron_ext.comm import Topology

    topo = Topology(ranks_per_node=a.ranks_per_node)
    results: Dict[str, Dict[str, Dict]] = {}
    sweep: Dict[str, Dict[str, Dict[str, Dict]]] = {}
    plans = a.plans.split(",") if a.mode == "gpt" else ["zero2"]
    engines = {"on": [True], "off": [False], "both": [True, False]}[a.progress_engine]
    sizes = sweep_sizes(a) if a.mode == "gpt" else []
    peers = [p for p in a.peers.split(",") if p] if a.mode == "gpt" else []
    for key in [p for p in peers if p.startswith("deepspeed")]:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            if a.rank == 0:
                print(f"  {PEERS[key][0]}: skipped (deepspeed is not installed)", flush=True)
            peers.remove(key)
    switch = RateSwitch(a.at_rates.split(","), a.nodes, a.prefix, a.rank, dist.barrier)
    for i in range(a.repeats):
        if i:
            switch.next_round()
        _measure_rows(topo, a, plans, engines, sizes, switch, results, sweep)
        for key in peers:
            name, fn = PEERS[key]
            for rate in switch.each():
                r = _add(results.setdefault(rate, {}), name, fn(topo, a))
                if a.rank == 0:
                    print(f"  {switch.tag(rate)}{name:<22} {1e3 * statistics.median(r['times_s'][-1:]):9.1f} ms/step",
                          flush=True)
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump({rate: {"rows": results.get(rate, {}), "sweep": sweep.get(rate, {})} for rate in switch.rates},
                      f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------------------
# orchestrator side
# ------------------------------------------------------------------------------------------------------------------
def set_link_rate(nodes: int, rate: str, prefix: str) -> None:
    """Re-shape every link of the cluster (from the host or from inside a node namespace: the helper enters each
    namespace by name)."""
    subprocess.run([HELPER, "rate", str(nodes), rate, prefix], check=True)


class Cluster:
    """The namespaces of one benchmark run; removed on exit, error or signal."""

    def __init__(self, nodes: int, rate: str, prefix: str) -> None:
        self.nodes, self.prefix = nodes, prefix
        self.down()   # leftovers of an interrupted run with the same prefix
        subprocess.run([HELPER, "up", str(nodes), rate, prefix], check=True)

    def set_rate(self, rate: str) -> None:
        set_link_rate(self.nodes, rate, self.prefix)

    def down(self) -> None:
        subprocess.run([HELPER, "down", str(self.nodes), self.prefix], check=False)

    def ns(self, node: int) -> str:
        return f"{self.prefix}{node}"


def run_rates(cluster: Cluster, a, rates: List[str], forward: List[str]) -> Dict[str, Dict]:
    """One set of ranks measuring every row at ``rates`` (the cluster shaped to the first): per rate, its rows and
    sweep points."""
    P = a.nodes * a.ranks_per_node
    with tempfile.TemporaryDirectory(prefix="mx_bench_cluster_") as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "out.json")
        procs = []
        try:
            for r in range(P):
                node = r // a.ranks_per_node
                env = ["env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1", f"PYTHONPATH={ROOT}",
                       f"LOCAL_WORLD_SIZE={a.ranks_per_node}", f"TORCH_EXTENSIONS_DIR={a.extensions_dir}"]
                cmd = ["ip", "netns", "exec", cluster.ns(node), *env, sys.executable, os.path.abspath(__file__),
                       "--worker", "--rank", str(r), "--world", str(P), "--store", store, "--out", out,
                       "--at-rates", ",".join(rates), *forward]
                procs.append(subprocess.Popen(cmd))
            deadline = time.monotonic() + a.timeout * len(rates)
            for p in procs:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    raise RuntimeError(f"a rank exited with code {rc} at rate(s) {','.join(rates)}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        with open(out) as f:
            return json.load(f)


SYNC_SUFFIX = " (sync)"
SPEC_SUFFIX = " +spec"


def sweep_sizes(a) -> List[int]:
    """Bucket sizes of ``--sweep`` (the common ``--bucket-numel`` included whenever a sweep is asked for)."""
    if not a.sweep:
        return []
    return sorted({int(float(x)) for x in a.sweep.split(",") if x} | {a.bucket_numel}, reverse=True)


def _sweep_point(r: Dict) -> Dict:
    ledger = r.get("ledger") or {}
    return {"times_s": r["times_s"], "cpu_s": r.get("cpu_s"), "wire_per_node": r.get("wire_per_node"),
            "buckets": r.get("buckets"),
            "ledger_inter_per_node": (ledger.get("per_node") or {}).get("inter"),
            "phases_s": r.get("phases_s"), "wire_split": r.get("wire_split"),
            "speculative_rounds": r.get("speculative_rounds")}


def rate_bits_per_s(rate: str) -> Optional[float]:
    """tc rate string to bit/s (``unlimited``: None)."""
    r = rate.strip().lower()
    if r == "unlimited":
        return None
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(unit):
            return float(r[:-len(unit)]) * mult
    raise ValueError(f"unknown rate {rate!r}")


def _pipelined(compute_s: float, link_s: float, buckets: Optional[int]) -> float:
    """Two stages over ``buckets`` equal buckets (compute makes or uses a bucket, the link carries it): the longer
    stage plus one bucket of the shorter, the pipe's fill or drain (none when the bucket count is unknown)."""
    return max(compute_s, link_s) + (min(compute_s, link_s) / buckets if buckets else 0.0)


def phase_limit(floor: Dict, wire_split: Optional[Dict], bps: Optional[float],
                buckets: Optional[int] = None) -> Optional[float]:
    """The floor of this design's step on this link. A bucket's new weights exist only after the global clipping
    norm, which needs every gradient, and the step updates every bucket before the first gather: the weight gathers
    can hide only behind the next forward, the gradient reductions only behind the last backward, each as a pipe of
    ``buckets`` buckets (:func:`_pipelined`): ``rest + update + pipe(forward, gather bytes / rate) + pipe(backward,
    reduce bytes / rate)``, with the phase times and ``rest`` (step - phases) of the no-link run ``floor``. Always
    >= the limit max(floor, bytes / rate)."""
    phases = floor.get("phases_s")
    if not phases or not wire_split or not bps:
        return None
    step = statistics.median(floor["times_s"])
    fwd, bwd, upd = (statistics.median(phases[k]) for k in ("forward", "backward", "update"))
    rest = max(0.0, step - fwd - bwd - upd)
    return (rest + upd + _pipelined(fwd, wire_split["gather"] * 8 / bps, buckets)
            + _pipelined(bwd, wire_split["reduce"] * 8 / bps, buckets))


def summarize(results: Dict[str, Dict], sweeps: Dict[str, Dict], peer_names: List[str]) -> Dict[str, Dict]:
    """Per rate and row: the common-size step, the best bucket size of the sweep, the limit
    ``max(no-link step, cross-node bytes per node / link rate)`` (no-link step: the same row and bucket size on the
    ``unlimited`` run, when there is one) and the ratio of the best step to its limit, the same for
    :func:`phase_limit` where the rows have phase times, plus best-against-best speedups over plain."""
    floor_rate = "unlimited" if "unlimited" in results else None
    out: Dict[str, Dict] = {}
    for rate, rows in results.items():
        bps = rate_bits_per_s(rate)
        summ: Dict[str, Dict] = {}
        for label, row in rows.items():
            points = {str(row.get("bucket_numel", "common")): _sweep_point(row)}
            points.update(sweeps.get(rate, {}).get(label, {}))
            best_key = min(points, key=lambda k: statistics.median(points[k]["times_s"]))
            best = points[best_key]
            floor = _floor_point(results, sweeps, floor_rate, label, best_key)
            wire = best.get("wire_per_node") or best.get("ledger_inter_per_node") or 0.0
            link = wire * 8 / bps if bps else 0.0
            limit = max(statistics.median(floor["times_s"]), link) if floor else (link or None)
            plimit = ((phase_limit(floor, best.get("wire_split"), bps, best.get("buckets")) if bps else limit)
                      if floor else None)
            best_ms = statistics.median(best["times_s"])
            summ[label] = {"common_ms": 1e3 * statistics.median(row["times_s"]),
                           "common_cpu_s": statistics.median(row["cpu_s"]) if row.get("cpu_s") else None,
                           "best_bucket": best_key,
                           "best_ms": 1e3 * best_ms, "best_buckets": best.get("buckets"),
                           "limit_ms": 1e3 * limit if limit else None,
                           "ratio_to_limit": best_ms / limit if limit else None,
                           "phase_limit_ms": 1e3 * plimit if plimit else None,
                           "ratio_to_phase_limit": best_ms / plimit if plimit else None,
                           "peer": label in peer_names}
        plain = summ.get("plain")
        # The lossless baseline a GPU cluster has: plain's reduce-scatter on gloo sends an all-reduce's bytes, so
        # the faster of plain and ring (NCCL's ring, comm/ring.py) is the honest one on a slow link.
        lossless = [summ[k]["best_ms"] for k in LOSSLESS_BASELINES if k in summ]
        for v in summ.values():
            v["speedup_vs_best_plain"] = plain["best_ms"] / v["best_ms"] if plain else None
            v["speedup_vs_best_lossless"] = min(lossless) / v["best_ms"] if lossless else None
            # Per-bucket overhead (issue 14: within 1.10x of plain at the common bucket size, no link): the wall
            # time, and the CPU seconds, which on an oversubscribed host show the overhead without the noise.
            v["common_vs_plain"] = v["common_ms"] / plain["common_ms"] if plain else None
            v["cpu_vs_plain"] = (v["common_cpu_s"] / plain["common_cpu_s"]
                                 if plain and v["common_cpu_s"] and plain["common_cpu_s"] else None)
        out[rate] = summ
    return out


def _floor_point(results: Dict[str, Dict], sweeps: Dict[str, Dict], floor_rate: Optional[str], label: str,
                 key: str) -> Optional[Dict]:
    """The no-link run of row ``label`` at bucket size ``key`` (the common row or its sweep point), if measured."""
    if floor_rate is None or label not in results[floor_rate]:
        return None
    frow = results[floor_rate][label]
    if key == str(frow.get("bucket_numel", "common")):
        return frow
    return sweeps.get(floor_rate, {}).get(label, {}).get(key)


def render_summary(summary: Dict[str, Dict]) -> str:
    lines = ["best against best: each row at its best bucket size of the sweep; limit = max(no-link step, "
             "cross-node bytes per node / link rate); phase limit = the floor when the gathers hide only behind "
             "forward and the reductions only behind backward, each a pipe of the row's buckets; "
             "speedup = best plain / best row; vs lossless = the faster of best plain and best ring / best row; "
             "common/plain and cpu/plain: step time and CPU seconds per step "
             "(all ranks, all threads) at the common bucket size over plain's"]
    hdr = f"{'row':<24}{'rate':>10}{'common ms':>11}{'best ms':>9}{'bucket':>10}{'#b':>4}{'limit ms':>10}" \
          f"{'x limit':>9}{'phase ms':>10}{'x phase':>9}{'speedup':>9}{'lossless':>9}{'common/plain':>13}" \
          f"{'cpu/plain':>10}"
    lines += [hdr, "-" * len(hdr)]

    def ms(x: Optional[float]) -> str:
        return f"{x:>10.1f}" if x else f"{'-':>10}"

    def ratio(x: Optional[float]) -> str:
        return f"{x:>8.2f}x" if x else f"{'-':>9}"

    for rate, rows in summary.items():
        for label, v in rows.items():
            nb = v.get("best_buckets") or "-"
            lines.append(f"{label:<24}{rate:>10}{v['common_ms']:>11.1f}{v['best_ms']:>9.1f}{v['best_bucket']:>10}"
                         f"{nb:>4}{ms(v['limit_ms'])}{ratio(v['ratio_to_limit'])}{ms(v.get('phase_limit_ms'))}"
                         f"{ratio(v.get('ratio_to_phase_limit'))}{ratio(v['speedup_vs_best_plain'])}"
                         f"{ratio(v.get('speedup_vs_best_lossless'))}"
                         f"{ratio(v.get('common_vs_plain')):>13}{ratio(v.get('cpu_vs_plain')):>10}")
    return "\n".join(lines)


def render(all_results: Dict[str, Dict], a) -> str:
    rates = list(all_results)
    labels = [l for l in all_results[rates[0]]]
    base = labels[0]
    lines = [f"mode={a.mode}, {a.nodes} nodes x {a.ranks_per_node} ranks, "
             + (f"{a.buckets} bucket(s) of {a.bucket_numel / 1e6:.1f}M {a.dtype} elements" if a.mode == "raw"
                else f"GPT {a.layers}x{a.hidden}, vocab {a.vocab}, seq {a.seq}, micro-batch {a.micro_batch} x "
                     f"{a.micro_batches} per step, bucket {a.bucket_numel / 1e6:.2f}M elements"),
             ("ms per step (median over iterations of the max over ranks)" if a.mode == "raw" else
              f"ms per step (mean of {a.iters} back-to-back steps, max over ranks"
              + (f"; median of {a.repeats} interleaved rounds)" if a.repeats > 1 else ")"))
             + f"; speedup = '{base}' / row; "
             "ledger and wire = MiB sent across nodes per node per step (wire: eth0 counter, TCP/IP included); "
             "state = model-state MB per rank"]
    hdr = f"{'row':<24}" + "".join(f"{r + ' ms':>14}{'speedup':>9}{'ledger':>9}{'wire':>9}" for r in rates)
    hdr += f"{'state MB':>10}"
    lines += [hdr, "-" * len(hdr)]
    for l in labels:
        row = f"{l:<24}"
        for r in rates:
            res = all_results[r].get(l)
            ref = all_results[r].get(base)
            if res is None:
                row += f"{'-':>14}{'-':>9}{'-':>9}{'-':>9}"
                continue
            med = statistics.median(res["times_s"])
            speedup = f"{statistics.median(ref['times_s']) / med:>8.2f}x" if ref else f"{'-':>9}"
            ledger = res.get("ledger")
            led = f"{ledger['per_node']['inter'] / 2 ** 20:>9.2f}" if ledger else f"{'n/a':>9}"
            wire = res.get("wire_per_node")
            wire_s = f"{wire / 2 ** 20:>9.2f}" if wire else f"{'-':>9}"
            row += f"{1e3 * med:>14.1f}{speedup}{led}{wire_s}"
        state = all_results[rates[0]][l].get("model_state_bytes")
        row += f"{state / 1e6:>10.2f}" if state else f"{'-':>10}"
        lines.append(row)
    lines.append(SEED_000_LOW_BW)
    return "\n".join(lines)


def link_phases(r: Dict, bps: Optional[float]) -> Optional[Dict[str, Dict[str, float]]]:
    """Per phase of an ODO row (the common bucket size): ms, MB per node on the link, and the share of the phase
    the link was busy (bytes / rate / time); ``other`` is what the step spent outside them, with no busy share (its
    time is the step's less the phases' maxima over ranks, its bytes the first round's total less the phases': the
    two do not describe one interval). None without phases."""
    phases, wire = r.get("phases_s"), r.get("wire_phases")
    if not phases or not wire:
        return None
    out: Dict[str, Dict[str, float]] = {}
    step = statistics.median(r["times_s"])
    for k in list(phases) + ["other"]:
        t = statistics.median(phases[k]) if k in phases else max(0.0, step - sum(
            statistics.median(v) for v in phases.values()))
        b = statistics.median(wire[k]) if k in wire else max(0.0, (r.get("wire_per_node") or 0.0) - sum(
            statistics.median(v) for v in wire.values()))
        busy = (b * 8 / bps / t) if bps and t > 0 and k != "other" else None
        out[k] = {"ms": 1e3 * t, "mb": b / 1e6, "busy": busy}
    return out


def render_link_phases(all_results: Dict[str, Dict]) -> str:
    """Where each row's link idles: per phase, ms / MB per node / busy share (rated links only)."""
    lines = ["link per phase (common bucket size): ms / MB per node sent / share of the phase the link was busy"]
    for rate, rows in all_results.items():
        bps = rate_bits_per_s(rate)
        if not bps:
            continue
        for label, r in rows.items():
            ph = link_phases(r, bps)
            if ph:
                lines.append(f"{label:<24}{rate:>9} " + "  ".join(
                    f"{k} {v['ms']:.0f}/{v['mb']:.1f}/" + (f"{100 * v['busy']:.0f}%" if v["busy"] is not None else "-")
                    for k, v in ph.items()))
    return "\n".join(lines) if len(lines) > 1 else ""


def render_link_timeline(all_results: Dict[str, Dict], per_line: int = 20) -> str:
    """``--link-timeline``: per rated link and ODO row, where its phases ended and node 0's link busy share (%) in
    each window of the sampled step."""
    lines = []
    for rate, rows in all_results.items():
        bps = rate_bits_per_s(rate)
        for label, r in rows.items():
            tl = r.get("link_timeline")
            if not bps or not tl:
                continue
            ends = ", ".join(f"{k[:-4]} {v:.0f}" for k, v in tl["marks_ms"].items())
            lines.append(f"{label} at {rate}: node 0's link busy % per {tl['window_ms']:.0f} ms window; the phases "
                         f"ended at (ms) {ends}")
            busy = [(ms, 100 * b * 8 / bps) for ms, b in tl["bytes_per_s"]]
            for i in range(0, len(busy), per_line):
                chunk = busy[i:i + per_line]
                lines.append(f"  {chunk[0][0]:>6.0f} ms: " + " ".join(f"{pct:>3.0f}" for _, pct in chunk))
    return "\n".join(lines)


def rescore(path: str) -> int:
    """The summary of a stored run, recomputed (a run from before the phase times gets no phase limit)."""
    with open(path) as f:
        doc = json.load(f)
    peers = [PEERS[p][0] for p in doc["config"].get("peers", "").split(",") if p in PEERS]
    doc["summary"] = summarize(doc["results"], doc.get("sweep", {}), peers)
    print(render_summary(doc["summary"]))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["raw", "gpt"], default="raw")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rates", default="1gbit,100mbit", help="comma-separated tbf rates of the inter-node links")
    ap.add_argument("--bucket-numel", type=int, default=4_000_000, help="elements per bucket")
    ap.add_argument("--buckets", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--group-size", type=int, default=2048)
    ap.add_argument("--stages", type=int, default=0,
                    help="qgZ pipeline stages per bucket (0: the ODO's auto rule; raw mode: 2)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over all rows, interleaved (with --rate-order interleave each round also reverses "
                    "the order of the rates); each row reports the median of its rounds")
    ap.add_argument("--combos", default="", help="comma-separated subset of: " + ",".join(c.label for c in COMBOS)
                    + ",DeepSpeed (gpt mode)")
    ap.add_argument("--plans", default="zero2",
                    help="gpt mode: comma-separated sharding plans, of: " + ",".join(PLAN_PRESETS))
    ap.add_argument("--micro-batches", type=int, default=1, help="gpt mode: micro-batches per step")
    ap.add_argument("--peers", default="deepspeed-zero2",
                    help="gpt mode: comma-separated peers, of: " + ",".join(PEERS) + " ('' for none)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--progress-engine", choices=["on", "off", "both"], default="on",
                    help="gpt mode: the ODO's progress engine (comm/progress.py); both: every combo also without it, "
                    "as row '<combo> (sync)'")
    ap.add_argument("--speculative-step", choices=["off", "on", "both"], default="off",
                    help="gpt mode: rows with the speculative step (optimizer/speculative_step.py), labelled '"
                    + SPEC_SUFFIX.strip() + "'; both: beside the usual rows")
    ap.add_argument("--clip-grad", type=float, default=1.0,
                    help="gpt mode: the ODO rows' global gradient clipping (Megatron's default 1.0; 0: none)")
    ap.add_argument("--link-timeline", action="store_true",
                    help="gpt mode: sample node 0's link every 2 ms through each ODO row's last timed step and print "
                         "its busy share per 25 ms window with the phases' ends (link_timeline in the JSON); a "
                         "diagnostic: the sampling thread runs on rank 0 in every step and slows it a little")
    ap.add_argument("--sweep", default="",
                    help="gpt mode: comma-separated bucket sizes (elements); every combo also runs at each, and the "
                    "summary compares each at its best (--bucket-numel is the common size)")
    ap.add_argument("--floor", action="store_true",
                    help="also measure on an unlimited link (the no-link floor of every row and bucket size) and "
                    "report each row's limit max(floor, cross-node bytes / rate)")
    ap.add_argument("--rate-order", choices=["interleave", "pass"], default="interleave",
                    help="interleave: one set of ranks measures each row (and sweep point) at every rate back to "
                    "back, rank 0 changing the links' rate between them and each round reversing the order, so a "
                    "row's no-link floor and its rated steps see the same spell of a shared host; pass: one pass "
                    "over every row per rate (the order of runs 1-18 in docs/benchmarks)")
    ap.add_argument("--prefix", default="mxbc", help="namespace name prefix")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds per rate the ranks may take (interleaved: the rates' sum for the one set of ranks)")
    ap.add_argument("--extensions-dir", default=default_extensions_dir(),
                    help="writable TORCH_EXTENSIONS_DIR for the op DeepSpeed compiles on first use")
    ap.add_argument("--json", default="bench_cluster.json")
    ap.add_argument("--rescore", metavar="JSON",
                    help="recompute the summary of a stored --json run with this code (no cluster, no root) and write "
                    "it back to that file")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--at-rates", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if any(x is not None for x in (a.out, a.rank, a.world, a.store, a.at_rates)):  # the workers' own: forwarded
        ap.error("--out, --rank, --world, --store and --at-rates are the workers' flags; the results go to --json FILE")
    if a.rescore:
        return rescore(a.rescore)
    if os.geteuid() != 0:
        ap.error("needs root to create network namespaces")
    os.makedirs(a.extensions_dir, exist_ok=True)
    forward = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--worker"]
    rates = a.rates.split(",")
    if a.floor and "unlimited" not in rates:
        rates = ["unlimited"] + rates
    cluster = Cluster(a.nodes, rates[0], a.prefix)

    def on_signal(signum, frame):
        cluster.down()
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    results: Dict[str, Dict] = {}
    sweeps: Dict[str, Dict] = {}
    try:
        # One set of ranks measuring every row at each rate in turn, or (--rate-order pass) a pass per rate.
        for group in ([rates] if a.rate_order == "interleave" else [[r] for r in rates]):
            cluster.set_rate(group[0])
            print(f"link rate {' / '.join(group)}:", flush=True)
            for rate, got in run_rates(cluster, a, group, forward).items():
                results[rate], sweeps[rate] = got["rows"], got["sweep"]
    finally:
        cluster.down()
    print(render(results, a))
    if a.mode == "gpt":
        print(render_link_phases(results))
        if a.link_timeline:
            print(render_link_timeline(results))
    summary = None
    if a.mode == "gpt" and (a.sweep or a.floor):
        summary = summarize(results, sweeps, [PEERS[p][0] for p in a.peers.split(",") if p in PEERS])
        print(render_summary(summary))
    if a.json:
        worker_only = ("worker", "rank", "world", "store", "out", "at_rates")
        doc = {"config": {k: v for k, v in vars(a).items() if k not in worker_only},
               "results": results, "seed_000": SEED_000_LOW_BW}
        if a.sweep:
            doc["sweep"] = sweeps
        if summary is not None:
            doc["summary"] = summary
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
