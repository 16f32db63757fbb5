"""Rank bodies and oracles shared by the comm backend tests.

One spawned world runs every backend on the same inputs (spawning is the expensive part on 2 CPU cores), and the
tests compare the results with the plain backend, with each other and with closed-form byte counts.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

# (label, backend kind, backend name, BackendOptions kwargs)
GRAD_CASES: List[Tuple[str, str, Dict]] = [
    ("plain", "plain", {}),
    ("qgz4", "qgz", {"qgz_bits": 4}),
    ("qgz8", "qgz", {"qgz_bits": 8}),
    ("bytegrad", "bytegrad", {}),
    ("ring", "ring", {}),
]


def make_bucket(seed: int, rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gradient-like data: normal values with a few large outliers and a slowly varying magnitude."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x *= torch.linspace(0.1, 2.0, numel, dtype=torch.float64)
    spikes = torch.rand(numel, generator=g, dtype=torch.float64) < 0.01
    x[spikes] *= 20.0
    return x.to(dtype)


class _Capture(logging.Handler):
    """Keeps the messages megatron_ext logs in this rank (to check who announces what, and how often)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def capture_logs() -> _Capture:
    log = logging.getLogger("megatron_ext")
    log.setLevel(logging.WARNING)
    log.propagate = False
    cap = _Capture()
    log.addHandler(cap)
    return cap


def run_all_backends(ranks_per_node: int, n: int, seed: int, options: Dict, dtype_name: str = "float32",
                     grad_cases=None) -> Dict:
    """Rank body: every grad-reduce case on this rank's bucket, then qwZ on this rank's shard of it."""
    from megatron_ext.comm import BackendOptions, CommLedger, Topology, build_grad_reduce, build_param_gather

    dtype = getattr(torch, dtype_name)
    logs = capture_logs()
    topo = Topology(ranks_per_node=ranks_per_node)
    P, r = topo.size, topo.rank
    bucket = make_bucket(seed, r, P * n, dtype)
    out: Dict = {"grad": {}, "ledger": {}}
    for label, name, extra in (grad_cases or GRAD_CASES):
        ledger = CommLedger()
        backend = build_grad_reduce(name, topo, ledger, BackendOptions(**{**options, **extra}))
        shard = torch.full((n,), float("nan"), dtype=dtype)
        src = bucket.clone()
        backend.reduce_scatter(src, shard).wait()
        assert torch.equal(src, bucket), f"{label} modified its input bucket"
        out["grad"][label] = shard
        out["ledger"][label] = ledger.summary()
    # ByteGrad's reduce-scatter into the bucket's own shard (it writes results where they end up: at one rank per node
    # straight into out_shard, with no copy of the bucket to read from)
    if not grad_cases or any(name == "bytegrad" for _, name, _ in grad_cases):
        own = bucket.clone()
        build_grad_reduce("bytegrad", topo, CommLedger(), BackendOptions(**options)).reduce_scatter(
            own, own[r * n:(r + 1) * n]).wait()
        out["bytegrad_in_place"] = own[r * n:(r + 1) * n].clone()
    # ByteGrad's all-reduce (a sharding plan's replica reduction): Bagua's whole flow, every rank the whole bucket.
    ledger = CommLedger()
    ar = bucket.clone()
    build_grad_reduce("bytegrad", topo, ledger, BackendOptions(**options)).all_reduce(ar).wait()
    out["bytegrad_all_reduce"] = {"result": ar, "ledger": ledger.summary()}
    # Averaging exactly once: a constant every quantizer represents (nearly) exactly must come back unchanged.
    out["const"] = {}
    for label, name, extra in (grad_cases or GRAD_CASES):
        backend = build_grad_reduce(name, topo, CommLedger(), BackendOptions(**{**options, **extra}))
        shard = torch.empty(n)
        backend.reduce_scatter(torch.full((P * n,), 0.75), shard).wait()
        out["const"][label] = shard
    out["qgz_events"] = qgz_event_order(topo, n, options)
    # Tiny buckets (fewer elements than stages or groups; empty): padded, never a fallback.
    out["tiny"] = {}
    for tiny in (0, 1, 3):
        x = make_bucket(seed + 1, r, P * tiny)
        for label, name, extra in (grad_cases or GRAD_CASES):
            backend = build_grad_reduce(name, topo, CommLedger(), BackendOptions(**{**options, **extra}))
            shard = torch.empty(tiny)
            backend.reduce_scatter(x, shard).wait()
            out["tiny"][(label, tiny)] = shard
        buf = x.clone()
        build_param_gather("qwz", topo, CommLedger(), BackendOptions(**options)).all_gather(
            buf[r * tiny:(r + 1) * tiny], buf).wait()
        out["tiny"][("qwz", tiny)] = buf
    try:
        Topology(ranks_per_node=3 if P % 3 else 5, create_subgroups=False)
        out["bad_rpn_error"] = None
    except ValueError as e:
        out["bad_rpn_error"] = str(e)
    for label, name in (("plain_ag", "plain"), ("qwz", "qwz")):
        ledger = CommLedger()
        backend = build_param_gather(name, topo, ledger, BackendOptions(**options))
        buf = torch.full((P * n,), float("nan"), dtype=dtype)
        buf[r * n:(r + 1) * n].copy_(bucket[r * n:(r + 1) * n])
        backend.all_gather(buf[r * n:(r + 1) * n], buf).wait()    # the shard aliases its slice, as in the ODO
        out["grad"][label] = buf
        out["ledger"][label] = ledger.summary()
    out["advance"] = advance_in_fifo_order(topo, n, seed, options, dtype, grad_cases or GRAD_CASES)
    out["topology"] = topology_checks(topo.size)
    out["logs"] = list(logs.messages)
    return out


def advance_in_fifo_order(topo, n: int, seed: int, options: Dict, dtype: torch.dtype, grad_cases) -> Dict:
    """Three buckets per case, reduced twice: each waited for at once (reference), and kept in flight the way the
    ODO drives them -- launch bucket k, then ``advance()`` every earlier in-flight bucket, oldest first, then
    ``wait()`` all. Records, per bucket launch, the ledger's call counts (they are recorded when a hop launches)."""
    from megatron_ext.comm import BackendOptions, CommLedger, build_grad_reduce

    K = 3
    buckets = [make_bucket(seed + 10 + k, topo.rank, topo.size * n, dtype) for k in range(K)]
    out: Dict = {}
    for label, name, extra in grad_cases:
        opts = BackendOptions(**{**options, **extra})
        backend = build_grad_reduce(name, topo, CommLedger(), opts)
        ref = []
        for b in buckets:
            shard = torch.full((n,), float("nan"), dtype=dtype)
            backend.reduce_scatter(b, shard).wait()
            ref.append(shard)
        ledger = CommLedger()
        backend = build_grad_reduce(name, topo, ledger, opts)
        works, shards, calls = [], [], []
        for b in buckets:
            shard = torch.full((n,), float("nan"), dtype=dtype)
            works.append(backend.reduce_scatter(b, shard))
            shards.append(shard)
            for w in works[:-1]:
                w.advance()
            calls.append({k: e.calls for k, e in ledger.entries().items()})
        for w in works:
            w.wait()
            w.advance()   # no-op once done
        out[label] = {"ref": ref, "fifo": shards, "calls": calls}
    return out


def topology_checks(P: int) -> Dict:
    """ranks_per_node semantics: the errors and the defaults from LOCAL_WORLD_SIZE (no subgroups are built)."""
    import os

    from megatron_ext.comm import Topology

    out: Dict = {}
    try:
        Topology(ranks_per_node=2 * P, create_subgroups=False)
        out["too_large"] = None
    except ValueError as e:
        out["too_large"] = str(e)
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "2"      # regular: nodes of 2
        out["lws2"] = Topology(create_subgroups=False).num_nodes
        os.environ["LOCAL_WORLD_SIZE"] = "3"      # irregular for P in {4, 8}: one node, announced by DP rank 0
        out["lws3"] = Topology(create_subgroups=False).num_nodes
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return out


def qgz_event_order(topo, n: int, options: Dict) -> List[str]:
    """Launch / wait order of qgZ's all-to-alls for one bucket (to check the pipelining of the two hops)."""
    import torch.distributed as dist

    from megatron_ext.comm import BackendOptions, CommLedger, build_grad_reduce
    from megatron_ext.comm import qgz as qgz_mod

    events: List[str] = []
    real = dist.all_to_all_single

    class _Logged:
        def __init__(self, h, tag):
            self.h, self.tag = h, tag

        def wait(self):
            self.h.wait()
            events.append("wait " + self.tag)

    counts = {"intra": 0, "inter": 0}

    def logged(out, inp, group=None, async_op=False):
        hop = "intra" if group is topo.intra_group else "inter"
        tag = f"{hop}{counts[hop]}"
        counts[hop] += 1
        events.append("launch " + tag)
        return _Logged(real(out, inp, group=group, async_op=async_op), tag)

    qgz_mod.dist.all_to_all_single = logged
    try:
        be = build_grad_reduce("qgz", topo, CommLedger(), BackendOptions(**options))
        work = be.reduce_scatter(torch.ones(topo.size * n), torch.empty(n))
        events.append("constructed")
        work.wait()
    finally:
        qgz_mod.dist.all_to_all_single = real
    return events


# -- analytic error bounds -----------------------------------------------------------------------------------------
def group_reduce(x: torch.Tensor, groups_of, fn) -> torch.Tensor:
    """Per-element ``fn`` (amax or range) of the group each element of the 1-D ``x`` falls in.

    ``groups_of`` is a 1-D long tensor of group ids per element (ids need not be contiguous).
    """
    ids = groups_of
    k = int(ids.max()) + 1
    if fn == "absmax":
        v = torch.zeros(k, dtype=x.dtype).scatter_reduce(0, ids, x.abs(), reduce="amax", include_self=True)
        return v[ids]
    hi = torch.full((k,), -float("inf"), dtype=x.dtype).scatter_reduce(0, ids, x, reduce="amax", include_self=True)
    lo = torch.full((k,), float("inf"), dtype=x.dtype).scatter_reduce(0, ids, x, reduce="amin", include_self=True)
    return (hi - lo)[ids]


def qgz_group_ids(P: int, n: int, stages: int, group_size: int) -> torch.Tensor:
    """Quantization group of every bucket element under qgZ's geometry (groups never straddle sub-slices)."""
    from megatron_ext.comm.qgz import qgz_geometry

    S, sub, G, g, _ = qgz_geometry(n, stages, group_size)
    j = torch.arange(n)
    local = (j // sub) * G + (j % sub) // g
    per_shard = S * G
    return (torch.arange(P).unsqueeze(1) * per_shard + local.unsqueeze(0)).reshape(-1)


def qgz_bound(xs: List[torch.Tensor], nodes: int, rpn: int, n: int, bits: int, stages: int,
              group_size: int) -> torch.Tensor:
    """Per-element bound on |qgZ - exact average| over the whole bucket (fp64)."""
    P = nodes * rpn
    qm = (1 << (bits - 1)) - 1
    ids = qgz_group_ids(P, n, stages, group_size)
    s1 = [group_reduce(x, ids, "absmax") / qm for x in xs]          # first quantization scale, per rank
    total = torch.zeros_like(xs[0])
    for a in range(nodes):
        members = range(a * rpn, (a + 1) * rpn)
        e1 = sum(s1[q] / 2 for q in members)
        total += e1
        if nodes > 1 and rpn > 1:                                     # requantization of the node's partial sum
            partial = sum(xs[q] for q in members)
            e1_max = group_reduce(e1, ids, "absmax")
            total += (group_reduce(partial, ids, "absmax") + e1_max) / qm / 2
    return total / P


def bytegrad_bound(xs: List[torch.Tensor], nodes: int, rpn: int, chunk: int, all_reduce: bool = False
                   ) -> torch.Tensor:
    """Per-element bound on |ByteGrad - exact average| (fp64): the reduce-scatter's one min-max UINT8 round (each
    node's sum quantized, half a step of ``range / 255`` per element), and for the all-reduce a second round (the
    averaged block, which already carries the first round's error, quantized again)."""
    P = nodes * rpn
    if nodes == 1:   # flat form: every rank its own "node"
        nodes, rpn = P, 1
    B = xs[0].numel()
    L = B // nodes
    c = chunk or L
    j = torch.arange(B)
    ids = (j // L) * (-(-L // c)) + (j % L) // c
    eps = 1e-7
    e1 = torch.zeros_like(xs[0])
    for a in range(nodes):
        node_sum = sum(xs[q] for q in range(a * rpn, (a + 1) * rpn))
        e1 += (group_reduce(node_sum, ids, "range") + eps) / 510
    e1 /= P
    if not all_reduce:
        return e1
    avg = sum(xs) / P
    e2 = (group_reduce(avg, ids, "range") + 2 * group_reduce(e1, ids, "absmax") + eps) / 510
    return e1 + e2


def qwz_bound(x: torch.Tensor, P: int, n: int, group_size: int) -> torch.Tensor:
    from megatron_ext.comm.qwz import qwz_group

    g = qwz_group(n, group_size)
    j = torch.arange(P * n)
    ids = (j // n) * (-(-n // g)) + (j % n) // g
    return group_reduce(x, ids, "absmax") / 127 / 2


def kernels_both_ways(ranks_per_node: int, n: int, seed: int, options: Dict) -> Dict:
    """Rank body: the quantized backends end to end (qgZ INT4 / INT8 at 1 and 2 stages, ByteGrad's reduce-scatter
    and all-reduce, qwZ's all-gather), once with every kernel on the Triton launchers and once on the reference;
    both results per case. The Triton launchers write the wire rows in place and decode received rows where they
    lie (the CUDA path), the reference copies: the same bytes must come out."""
    from megatron_ext.comm import BackendOptions, CommLedger, Topology, build_grad_reduce, build_param_gather
    from megatron_ext.kernels import use_backend

    capture_logs()
    topo = Topology(ranks_per_node=ranks_per_node)
    P, r = topo.size, topo.rank
    bucket = make_bucket(seed, r, P * n)
    cases = [(f"qgz{bits}/stages={s}", "qgz", {"qgz_bits": bits, "qgz_pipeline_stages": s})
             for bits in (4, 8) for s in (1, 2)] + [("bytegrad", "bytegrad", {})]
    out: Dict = {}
    for kernels in ("triton", "torch"):
        with use_backend(kernels):
            for label, name, extra in cases:
                shard = torch.full((n,), float("nan"))
                build_grad_reduce(name, topo, CommLedger(), BackendOptions(**{**options, **extra})).reduce_scatter(
                    bucket.clone(), shard).wait()
                out[(label, kernels)] = shard
            ar = bucket.clone()
            build_grad_reduce("bytegrad", topo, CommLedger(), BackendOptions(**options)).all_reduce(ar).wait()
            out[("bytegrad all_reduce", kernels)] = ar
            buf = torch.full((P * n,), float("nan"))
            buf[r * n:(r + 1) * n].copy_(bucket[r * n:(r + 1) * n])
            build_param_gather("qwz", topo, CommLedger(), BackendOptions(**options)).all_gather(
                buf[r * n:(r + 1) * n], buf).wait()
            out[("qwz", kernels)] = buf
    return out
