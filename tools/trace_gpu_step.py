#!/usr/bin/env python
"""Where does the compute stream wait on communication? A torch.profiler trace of ODO steps on one GPU with a
multi-rank topology (issue 14's GPU check).

One process plays rank 0 of a ``--world-size`` world of ``--ranks-per-node`` ranks per node on torch's fake process
group (``torch.testing._internal.distributed.fake_pg``), so every code path of a multi-node job runs -- the progress
engine's communication stream, the backends' Triton kernels, the buffer pool, the forward pre-hooks -- on one GPU.
The fake group moves no data; each collective is replaced by an *emulated link* (``tools/fake_cluster.py``) that
treats the caller's streams as NCCL does and takes ``bytes / rate`` on a stream of its own.

Per phase of the step (forward, backward, finish = ``finish_grad_sync``, step), per step:

  * every wait of the compute stream on another stream (measured on the GPU by a pair of timing events around it,
    :class:`WaitProbe`), with what issued it (the buffer pool handing over a buffer, a consumer's ``wait()`` on an
    engine work, a ``wait()`` on a collective) and how long it held the compute stream up;
  * the host time spent in the progress engine's commands (on its thread or inline);
  * from a torch.profiler trace of as many more steps: the phase's host time, the blocking CUDA calls (stream /
    event / device synchronize, synchronous copies) and every CUDA call of 0.5 ms or more issued during it (any
    thread), and in the backward window the GPU busy time of the compute stream, of the communication streams, and
    their overlap.

    python tools/trace_gpu_step.py --json docs/benchmarks/gpu_trace_issue14.json     # on a CUDA machine
    python tools/trace_gpu_step.py --device cpu --width 64 --hidden 128 --depth 2    # plumbing check, no GPU
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_optimizer import Net  # noqa: E402
from fake_cluster import EmulatedLink, LinkWork, sleep_cycles_per_second  # noqa: E402
from megatron_ext.comm.combos import select_combos  # noqa: E402

PHASES = ("forward", "backward", "finish", "step")


# -- instrumentation ----------------------------------------------------------------------------------------------
class WaitProbe:
    """Measures every wait of the compute stream on another stream, on the GPU: a timing event recorded on the
    compute stream just before the wait and one just after; the time between them is how long the compute stream
    sat at the wait (a wait whose event had already completed costs about nothing). Each wait is labelled with the
    step phase the training thread is in and with the ODO call that issued it, the outermost of: the buffer pool
    handing over a buffer, a consumer's ``wait()`` on an engine work, a ``wait()`` on a collective."""

    def __init__(self, compute: "torch.cuda.Stream") -> None:
        self.compute = compute
        self.phase = "setup"
        self.records: List[Tuple[str, str, object, object]] = []
        self.engine_s = 0.0      # host time spent in the progress engine's commands (on its thread or inline)
        self._local = threading.local()
        self._lock = threading.Lock()

    def install(self) -> None:
        from megatron_ext.comm import progress
        from megatron_ext.optimizer import buffer_pool

        original = torch.cuda.Stream.wait_event
        probe = self

        def wait_event(stream, event):
            if stream != probe.compute:
                return original(stream, event)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            original(stream, event)
            after.record(stream)
            with probe._lock:
                probe.records.append((probe.phase, probe._source(), before, after))

        torch.cuda.Stream.wait_event = wait_event
        buffer_pool.BufferPool.acquire = self.labelled(buffer_pool.BufferPool.acquire, "pool_acquire")
        progress.EngineWork.wait = self.labelled(progress.EngineWork.wait, "engine_wait")
        LinkWork.wait = self.labelled(LinkWork.wait, "collective_wait")
        for name in ("_execute", "_complete_ready"):
            setattr(progress.ProgressEngine, name, self.timed(getattr(progress.ProgressEngine, name)))

    def labelled(self, fn, label: str):
        @functools.wraps(fn)
        def call(*a, **k):
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(label)
            try:
                with torch.profiler.record_function("mx." + label):
                    return fn(*a, **k)
            finally:
                stack.pop()
        return call

    def timed(self, fn):
        @functools.wraps(fn)
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.engine_s += time.perf_counter() - t0
        return call

    def _source(self) -> str:
        stack = self._local.__dict__.get("stack")
        return stack[0] if stack else "other"    # the outermost: why the compute stream waits

    def reset(self) -> None:
        self.records, self.engine_s = [], 0.0

    def stalls(self) -> List[Tuple[str, str, float]]:
        """(phase, source, stall ms) of each wait recorded since the last reset (after a device synchronize)."""
        return [(ph, src, before.elapsed_time(after)) for ph, src, before, after in self.records]


STALL_MS = 0.01   # a wait whose two timing events are further apart than this held the compute stream up


def summarize_waits(stalls: Sequence[Tuple[str, str, float]], steps: int) -> dict:
    """Per phase and per step: the compute stream's waits on other streams, how many held it up, for how long."""
    out = {}
    for phase in PHASES:
        mine = [(src, ms) for ph, src, ms in stalls if ph == phase]
        by_source: Dict[str, int] = {}
        for src, _ in mine:
            by_source[src] = by_source.get(src, 0) + 1
        out[phase] = {"waits_per_step": len(mine) / steps,
                      "stalled_per_step": sum(ms > STALL_MS for _, ms in mine) / steps,
                      "stall_ms_per_step": round(sum(ms for _, ms in mine) / steps, 4),
                      "max_stall_ms": round(max((ms for _, ms in mine), default=0.0), 4),
                      "by_source": by_source}
    return out


# -- trace analysis -----------------------------------------------------------------------------------------------
def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LONG_CALL_MS = 0.5   # a CUDA runtime / driver call this long held its thread up (whatever its name: cudaMalloc, ...)


def summarize_trace(events: List[dict]) -> dict:
    """From a Chrome trace of torch.profiler (``traceEvents``), per step (milliseconds): the compute stream (the one
    running most of the forward's kernels); the host time of each phase (its ``mx.<phase>`` annotation); the
    blocking CUDA calls issued during it and every CUDA call of ``LONG_CALL_MS`` or more (any thread); and in the
    backward window -- the first to the last compute-stream op launched during ``mx.backward`` -- the busy time of
    the compute stream, of every other stream, and their overlap."""
    x = [e for e in events if e.get("ph") == "X"]
    spans = {p: sorted((e["ts"], e["ts"] + e["dur"]) for e in x
                       if e.get("cat") == "user_annotation" and e["name"] == "mx." + p) for p in PHASES}
    steps = max(1, len(spans["backward"]))

    def phase_of(ts: Optional[float]) -> Optional[str]:
        for p, lst in spans.items():
            if ts is not None and any(s <= ts <= e for s, e in lst):
                return p
        return None

    runtime = {e["args"]["correlation"]: e for e in x
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = [(e, phase_of(runtime[e["args"]["correlation"]]["ts"]) if e["args"].get("correlation") in runtime else None)
           for e in x if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    forward_time: Dict[int, float] = {}
    for o, ph in ops:
        if ph == "forward" and o.get("cat") == "kernel":
            forward_time[o["args"]["stream"]] = forward_time.get(o["args"]["stream"], 0.0) + o["dur"]
    compute = max(forward_time, key=forward_time.get) if forward_time else None
    host_syncs: Dict[str, Dict[str, float]] = {p: {} for p in PHASES}
    long_calls: Dict[str, Dict[str, float]] = {p: {} for p in PHASES}
    for e in runtime.values():
        ph = phase_of(e["ts"])
        for table, hit in ((host_syncs, e["name"] in HOST_SYNCS), (long_calls, e["dur"] >= LONG_CALL_MS * 1e3)):
            if hit and ph is not None:
                table[ph][e["name"]] = table[ph].get(e["name"], 0) + 1 / steps
    busy = {"backward_gpu_ms": 0.0, "compute_busy_ms": 0.0, "comm_busy_ms": 0.0, "overlap_ms": 0.0}
    for s, e in spans["backward"]:
        launched = [o for o, ph in ops if o["args"].get("stream") == compute and ph == "backward"
                    and s <= runtime[o["args"]["correlation"]]["ts"] <= e]
        if not launched:
            continue
        lo, hi = min(o["ts"] for o in launched), max(o["ts"] + o["dur"] for o in launched)
        inside = [(o["args"].get("stream"), max(o["ts"], lo), min(o["ts"] + o["dur"], hi)) for o, _ in ops
                  if o["ts"] < hi and o["ts"] + o["dur"] > lo]
        comp = _union([(a, b) for st, a, b in inside if st == compute])
        comm = _union([(a, b) for st, a, b in inside if st != compute])
        busy["backward_gpu_ms"] += (hi - lo) / 1e3
        busy["compute_busy_ms"] += _length(comp) / 1e3
        busy["comm_busy_ms"] += _length(comm) / 1e3
        busy["overlap_ms"] += _length(_intersect(comp, comm)) / 1e3
    return {"compute_stream": compute,
            "host_ms_per_step": {p: round(sum(b - a for a, b in spans[p]) / 1e3 / steps, 3) for p in PHASES},
            "host_syncs_per_step": host_syncs, "long_cuda_calls_per_step": long_calls,
            "backward_per_step": {k: round(v / steps, 3) for k, v in busy.items()}}


# -- one configuration ---------------------------------------------------------------------------------------------
def _model_and_batch(args, device: torch.device):
    """The model (same initial weights every time) and the one batch every configuration trains on."""
    torch.manual_seed(1234)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    net = Net(args.width, args.hidden, args.depth).to(device, dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.width, generator=g).to(device, dtype)
    y = torch.randn(args.rows, args.width, generator=g).to(device, dtype)
    return net, x, y


def run_config(args, combo, pool_size: Optional[int], probe: Optional[WaitProbe], device: torch.device,
               engine: str = "inline") -> dict:
    """One ODO configuration. ``engine``: the progress engine ``inline`` (CUDA + NCCL's default; forced here, the
    fake group being no NCCL) or on its own ``thread`` (CPU's default), for comparison. The step time, the waits and
    the engine's host time come from ``--steps`` plain steps; the trace summary from as many more, profiled."""
    import megatron_ext as mx
    from megatron.core.optimizer import OptimizerConfig
    from megatron_ext.comm import progress

    net, x, y = _model_and_batch(args, device)
    original, progress.runs_inline = progress.runs_inline, lambda dev, backend: engine == "inline"
    try:
        model = mx.OverlappedDDP(net, mx.OverlapConfig(
            bucket_size=args.bucket_numel, grad_reduce=combo.grad_reduce, param_gather=combo.param_gather,
            qgz_bits=combo.qgz_bits, ranks_per_node=args.ranks_per_node, buffer_pool_size=pool_size,
            qgz_pipeline_stages=None))
    finally:
        progress.runs_inline = original
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=args.clip_grad, bf16=x.dtype == torch.bfloat16,
        fp16=False), model)
    skipped = [0]

    def phase(name: str):
        if probe is not None:
            probe.phase = name
        return torch.profiler.record_function("mx." + name)

    def step() -> None:
        with phase("forward"):
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        with phase("backward"):
            loss.backward()
        with phase("finish"):
            model.finish_grad_sync()
        with phase("step"):
            ok, _, _ = opt.step()
            opt.zero_grad()
        skipped[0] += not ok

    row = {"combo": combo.label, "grad_reduce": combo.grad_reduce, "param_gather": combo.param_gather,
           "buffer_pool_size": model.buffer_pool_size, "buckets": len(model.buckets),
           "engine": ("inline" if model.engine.inline else "thread") if model.engine is not None else "off",
           **_time_steps(step, args, device, probe)}
    if probe is not None:
        row["compute_stream_waits"] = summarize_waits(probe.stalls(), args.steps)
        row["engine_host_ms_per_step"] = round(probe.engine_s * 1e3 / args.steps, 3)
    if args.host_buckets:
        row["host_us_per_bucket"] = bucket_host_us(model, device, x.dtype, args.host_buckets)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        _synchronize(device)
    row["skipped_steps"] = skipped[0]
    if device.type == "cuda":
        name = f"{combo.label.replace(' ', '_').replace('+', '_')}_pool{model.buffer_pool_size}_{engine}"
        row.update(summarize_trace(_trace_events(prof, args.keep_trace, name)))
    return row


def bucket_host_us(model, device: torch.device, dtype: torch.dtype, buckets: int = 40, rounds: int = 5
                   ) -> Dict[str, float]:
    """Host time per bucket on the training thread, apart from any step: ``buckets`` reductions of the first bucket's
    size launched back to back, the oldest waited for once a third is launched, through the progress engine
    (``reduce_engine``) and through the backend alone (``reduce_backend``), and as many weight gathers
    (``gather``); the least of ``rounds`` rounds, in microseconds. On a GPU the launches return before the kernels
    run, so this is what a bucket costs the host (issue 14's per-bucket overhead), not the link."""
    b = model.buckets[0]
    bucket = torch.randn(b.numel, device=device)
    out = torch.empty(b.shard_numel, device=device)
    params = torch.randn(b.numel, device=device).to(dtype)
    engine_backend = model.grad_backend
    direct = getattr(engine_backend, "inner", engine_backend)

    def reduce(backend) -> None:
        works = []
        for _ in range(buckets):
            works.append(backend.reduce_scatter(bucket, out))
            if len(works) > 2:
                works.pop(0).wait()
        for w in works:
            w.wait()

    def gather() -> None:
        for _ in range(buckets):
            model.param_backend.all_gather(params[:b.shard_numel], params).wait()

    result = {}
    for name, fn in (("reduce_engine", lambda: reduce(engine_backend)), ("reduce_backend", lambda: reduce(direct)),
                     ("gather", gather)):
        best = float("inf")
        for _ in range(rounds + 1):   # the first round warms up
            _synchronize(device)
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        result[name] = round(best / buckets * 1e6, 1)
    _synchronize(device)
    return result


def run_no_comm(args, device: torch.device) -> dict:
    """The same model and batch with a local AdamW and no ODO: the step without any communication machinery."""
    net, x, y = _model_and_batch(args, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")

    def step() -> None:
        torch.nn.functional.mse_loss(net(x).float(), y.float()).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad()

    return {"combo": "no-comm (local AdamW)", **_time_steps(step, args, device)}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(step, args, device: torch.device, probe: Optional[WaitProbe] = None) -> dict:
    """Warm up, then the median wall time of ``--steps`` steps, each ended by a device synchronize (the probe
    records these steps only)."""
    for _ in range(args.warmup):
        step()
    _synchronize(device)
    if probe is not None:
        probe.reset()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        _synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"step_ms": round(statistics.median(times), 3), "step_ms_min_max": [round(min(times), 3),
                                                                              round(max(times), 3)]}


def _trace_events(prof, keep_dir: str, name: str) -> List[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if keep_dir:
            with open(path, "rb") as src, gzip.open(os.path.join(keep_dir, f"trace_{name}.json.gz"), "wb") as dst:
                dst.write(src.read())
    return events


def violations(rows: List[dict]) -> List[str]:
    """What ``--check`` refuses: a configuration that failed, a compute-stream wait in backward issued by anything
    but the buffer pool handing a buffer over, or a blocking CUDA call during backward."""
    out = []
    for r in rows:
        name = f"{r['combo']} ({r.get('engine')}, pool {r.get('buffer_pool_size')})"
        if "error" in r:
            out.append(f"{name}: {r['error']}")
            continue
        if "compute_stream_waits" not in r:
            continue
        others = {k: v for k, v in r["compute_stream_waits"]["backward"]["by_source"].items() if k != "pool_acquire"}
        if others:
            out.append(f"{name}: the compute stream waits on communication in backward: {others}")
        if r["host_syncs_per_step"]["backward"]:
            out.append(f"{name}: blocking CUDA calls in backward: {r['host_syncs_per_step']['backward']}")
    return out


def format_row(r: dict) -> str:
    head = f"{r['combo']:14s} {r.get('engine', ''):6s} pool {r.get('buffer_pool_size')} buckets {r.get('buckets', 0):3d}"
    if "error" in r:
        return f"{head} | error: {r['error']}"
    lo, hi = r.get("step_ms_min_max", (r["step_ms"], r["step_ms"]))
    line = f"{head} | step {r['step_ms']:7.1f} ms ({lo:.1f}-{hi:.1f})"
    per_bucket = r.get("host_us_per_bucket")
    if per_bucket:
        line += (" | host us per bucket: reduce {reduce_engine:.0f} (backend alone {reduce_backend:.0f}), "
                 "gather {gather:.0f}".format(**per_bucket))
    if "compute_stream_waits" not in r:
        return line
    bw, host = r["backward_per_step"], r["host_ms_per_step"]
    waits = " ".join(f"{ph} {w['waits_per_step']:g}/{w['stalled_per_step']:g}/{w['stall_ms_per_step']:.2f}ms"
                     f"{w['by_source']}" for ph, w in r["compute_stream_waits"].items())
    return (f"{line} | engine host {r['engine_host_ms_per_step']:.1f} ms | profiled host fwd/bwd/finish/step "
            f"{host['forward']:.1f}/{host['backward']:.1f}/{host['finish']:.1f}/{host['step']:.1f} ms"
            f" | backward GPU {bw['backward_gpu_ms']:.2f} ms: compute {bw['compute_busy_ms']:.2f}, comm "
            f"{bw['comm_busy_ms']:.2f}, overlap {bw['overlap_ms']:.2f}"
            f" | compute-stream waits (per step: count/stalled/stall): {waits}"
            f" | host syncs in backward: {r['host_syncs_per_step']['backward']}"
            f" | CUDA calls >= {LONG_CALL_MS} ms in backward: {r['long_cuda_calls_per_step']['backward']}")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--world-size", type=int, default=16)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--combos", default="plain,qwZ+qgZ INT4,ByteGrad", help="comma-separated (megatron_ext.comm.combos)")
    p.add_argument("--engines", default="inline", help="comma-separated: inline (the CUDA default), thread")
    p.add_argument("--pool-sizes", default="auto", help="comma-separated gradient buffer pool sizes; auto: the default")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--rows", type=int, default=8192, help="tokens per step (rows of the input)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--bucket-numel", type=int, default=10_000_000)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--link-gbit", type=float, default=400.0, help="emulated inter-node link, Gbit/s (0: no delay)")
    p.add_argument("--intra-gbit", type=float, default=3000.0,
                   help="emulated intra-node link, Gbit/s (0: no delay; default about one NVLink 4 direction)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--host-buckets", type=int, default=40,
                   help="reductions and gathers per round of the host-time-per-bucket measurement (0: skip it)")
    p.add_argument("--keep-trace", default="", help="folder for the gzipped Chrome traces (CUDA only)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if a configuration failed, or the compute stream waited in backward on anything but "
                        "the buffer pool, or a CUDA call blocked the host in backward")
    args = p.parse_args(argv)
    combos = select_combos([c.strip() for c in args.combos.split(",") if c.strip()])
    pools = [None if s.strip() == "auto" else int(s) for s in args.pool_sizes.split(",")]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if any(e not in ("inline", "thread") for e in engines):
        p.error(f"--engines: choose from inline, thread; got {args.engines!r}")
    if args.host_buckets < 0:
        p.error(f"--host-buckets must be >= 0, got {args.host_buckets}")
    if args.world_size % args.ranks_per_node:
        p.error(f"--world-size {args.world_size} is not a multiple of --ranks-per-node {args.ranks_per_node}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for the plumbing check)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    from torch.testing._internal.distributed.fake_pg import FakeStore
    os.environ["LOCAL_WORLD_SIZE"] = str(args.ranks_per_node)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    cycles = sleep_cycles_per_second() if device.type == "cuda" else 0.0
    link = EmulatedLink(args.ranks_per_node, args.link_gbit, args.intra_gbit, cycles)
    link.install()
    probe = None
    if device.type == "cuda":
        probe = WaitProbe(torch.cuda.default_stream(device))
        probe.install()

    rows = [run_no_comm(args, device)]
    print(f"{rows[0]['combo']:22s} step {rows[0]['step_ms']:7.1f} ms", flush=True)
    for combo, pool, engine in itertools.product(combos, pools, engines):
        try:
            rows.append(run_config(args, combo, pool, probe, device, engine))
        except Exception as e:  # noqa: BLE001 -- report it and go on with the next configuration
            traceback.print_exc()
            rows.append({"combo": combo.label, "buffer_pool_size": pool, "engine": engine, "error": repr(e)})
        print(format_row(rows[-1]), flush=True)
    meta = {"link_calls": link.calls, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "torch": torch.__version__,
            "sleep_cycles_per_s": cycles, "argv": sys.argv[1:], **vars(args),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    if args.check:
        bad = violations(rows)
        for line in bad:
            print("!!", line)
        if bad:
            sys.exit(1)
        print("check: no compute-stream wait on communication in backward but the buffer pool's handovers")


if __name__ == "__main__":
    main()
