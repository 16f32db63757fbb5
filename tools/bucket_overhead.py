#!/usr/bin/env python
"""Per-bucket overhead of each backend: collectives, torch ops ("kernel launches") and host time per bucket.

Why: with buckets small enough to overlap backward, what a backend costs per bucket -- independent of the bytes
it sends -- decides whether it can keep up with plain on a fast link (issue 14). One gloo world of
``--nodes x --ranks-per-node`` CPU processes on this machine (loopback: an unlimited link), every backend on
``--buckets`` buckets of ``--bucket-numel`` elements, launched back to back and then waited for, as the ODO does
during backward and at the step; the gradient reductions with the progress engine on and off (the weight gathers
run on the training thread only). ``all_reduce`` rows: a sharding plan's replica all-reduce (in place, on the whole
bucket, over the whole world: with ``--ranks-per-node 1`` the replica group of one rank per node).

Reported per bucket and backend: ``collectives`` (torch.distributed calls, counted by wrapping them), ``ops`` (aten
ops dispatched on the thread that runs the work: kernel launches on a GPU), ``launch_ms`` (host time of the
launching call on the training thread), ``wait_ms`` (host time the training thread spends in ``wait()``) and
``total_ms`` (launch all + wait all, per bucket). Median over ``--iters`` rounds, max over ranks.

    python tools/bucket_overhead.py --bucket-numel 400000 --buckets 14 --json docs/benchmarks/bucket_overhead.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

GRAD = [("plain", "plain", {}), ("qgz INT4", "qgz", {"qgz_bits": 4}), ("qgz INT8", "qgz", {"qgz_bits": 8}),
        ("bytegrad", "bytegrad", {})]
GATHER = [("plain", "plain"), ("qwz", "qwz")]
REPLICA = [("plain", "plain"), ("bytegrad", "bytegrad")]
COLLECTIVES = ("all_to_all_single", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather_single", "reduce", "broadcast", "all_reduce")


class _CountOps:
    """Counts aten ops dispatched on this thread (the engine off: every op of the work runs here)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.n += 1
                return func(*args, **(kwargs or {}))

        self.n = 0
        self.mode = Mode()


_COUNTS = {"n": 0}


def _count_collectives() -> Dict[str, int]:
    """Wraps the torch.distributed collectives (once per process) to count calls in ``_COUNTS``."""
    import torch.distributed as dist

    counts = _COUNTS
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_mx_counted", False):
            continue

        def wrapped(*args, _fn=fn, **kwargs):
            counts["n"] += 1
            return _fn(*args, **kwargs)

        wrapped._mx_counted = True
        setattr(dist, name, wrapped)
    return counts


def _measure(topo, make_backend, call, a, engine: bool) -> Dict:
    import torch
    import torch.distributed as dist

    from megatron_ext.comm.engine_backend import EngineGradReduce
    from megatron_ext.comm.progress import ProgressEngine

    backend = make_backend(topo.engine_clone() if engine else topo)
    if engine:
        eng = ProgressEngine()
        backend = EngineGradReduce(backend, eng)
    P = topo.size
    n = -(-a.bucket_numel // (P * 64)) * 64
    g = torch.Generator().manual_seed(topo.rank)
    buckets = [torch.randn(P * n, generator=g).to(getattr(torch, a.dtype)) for _ in range(a.buckets)]
    shards = [b[topo.rank * n:(topo.rank + 1) * n].clone() for b in buckets]
    counts = _count_collectives()
    rounds = []
    for it in range(a.warmup + a.iters):
        dist.barrier()
        c0 = counts["n"]
        t0 = time.perf_counter()
        launch = 0.0
        works = []
        for b, s in zip(buckets, shards):
            t = time.perf_counter()
            works.append(call(backend, b, s))
            launch += time.perf_counter() - t
        t1 = time.perf_counter()
        for w in works:
            w.wait()
        t2 = time.perf_counter()
        if it >= a.warmup:
            rounds.append({"launch_ms": 1e3 * launch / a.buckets, "wait_ms": 1e3 * (t2 - t1) / a.buckets,
                           "total_ms": 1e3 * (t2 - t0) / a.buckets, "collectives": (counts["n"] - c0) / a.buckets})
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    if not engine:   # op count: the whole work runs on this thread
        counter = _CountOps()
        dist.barrier()
        with counter.mode:
            works = [call(backend, b, s) for b, s in zip(buckets, shards)]
            for w in works:
                w.wait()
        out["ops"] = counter.n / a.buckets
    t = torch.tensor([out[k] for k in ("launch_ms", "wait_ms", "total_ms")], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out.update(launch_ms=t[0].item(), wait_ms=t[1].item(), total_ms=t[2].item())
    return out


def worker(rank: int, a, store: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = a.nodes * a.ranks_per_node
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from megatron_ext.comm import BackendOptions, CommLedger, Topology, build_grad_reduce, build_param_gather

    topo = Topology(ranks_per_node=a.ranks_per_node)
    res: Dict = {"reduce_scatter": {}, "all_gather": {}, "all_reduce": {}}
    for label, name, extra in GRAD:
        opts = BackendOptions(quant_group_size=a.group_size, qgz_pipeline_stages=a.stages, **extra)
        for engine in (False, True):
            r = _measure(topo, lambda t: build_grad_reduce(name, t, CommLedger(), opts),
                         lambda be, b, s: be.reduce_scatter(b, s), a, engine)
            res["reduce_scatter"].setdefault(label, {})["engine" if engine else "sync"] = r
    for label, name in GATHER:   # gathers run on the training thread only (no engine)
        opts = BackendOptions(quant_group_size=a.group_size)
        r = _measure(topo, lambda t: build_param_gather(name, t, CommLedger(), opts),
                     lambda be, b, s: be.all_gather(s, b), a, False)
        res["all_gather"][label] = {"sync": r}
    for label, name in REPLICA:
        opts = BackendOptions(quant_group_size=a.group_size)
        for engine in (False, True):
            r = _measure(topo, lambda t: build_grad_reduce(name, t, CommLedger(), opts),
                         lambda be, b, s: be.all_reduce(b), a, engine)
            res["all_reduce"].setdefault(label, {})["engine" if engine else "sync"] = r
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def render(res: Dict, a) -> str:
    lines = [f"{a.nodes} nodes x {a.ranks_per_node} ranks (loopback), {a.buckets} buckets of "
             f"{a.bucket_numel / 1e6:.2f}M {a.dtype} elements; per bucket, median of {a.iters}, max over ranks",
             f"{'op':<15}{'backend':<10}{'coll':>6}{'ops':>7}"
             + "".join(f"{m + ' ' + k:>16}" for m in ("sync", "engine") for k in ("launch", "wait", "total"))]
    for op, rows in res.items():
        for label, r in rows.items():
            line = f"{op:<15}{label:<10}{r['sync']['collectives']:>6.0f}{r['sync'].get('ops', 0):>7.0f}"
            for m in ("sync", "engine"):
                for k in ("launch_ms", "wait_ms", "total_ms"):
                    line += f"{r[m][k]:>16.2f}" if m in r else f"{'-':>16}"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bucket-numel", type=int, default=400_000)
    ap.add_argument("--buckets", type=int, default=14)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--group-size", type=int, default=2048)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mx_bucket_overhead_") as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "out.json")
        mp.start_processes(worker, args=(a, store, out), nprocs=a.nodes * a.ranks_per_node, start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    print(render(res, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": res}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
