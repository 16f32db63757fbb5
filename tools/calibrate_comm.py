#!/usr/bin/env python
"""Measure a cluster for the planner and write its profile JSON (``python -m megatron_ext.planner --profile``).

What it times, every rank at once (so shared links and shared processors are measured as training uses them):

- the collectives the backends use -- reduce-scatter, all-gather, all-reduce, all-to-all -- at several sizes, on
  node-local groups (every node's ranks, all nodes at once: the ``intra`` link) and on cross-node groups (one rank
  per node, every local index at once: the ``inter`` link, shared by the node's ranks); each (link, collective)
  gets an alpha-beta fit in the units of ``megatron_ext/planner/profile.py`` [Note: the cost of a collective];
- compute: the ODO's training step at DP 1 on the GPT shapes given with ``--gpt`` (megatron-core, as pretrain_gpt
  builds them), as forward + backward FLOP/s by Megatron's formula (the median of ``--windows`` windows); and
  forward + backward alone and beside a running collective (``overlap_slowdown``);
- the quantization kernels (bytes/s), the Adam update and the gradient hook's add into a bucket (s per element),
  the host cost of issuing a collective and -- GPU ranks -- of a quantized hop's codec calls, and -- CPU ranks --
  the compute time one collective hop takes from the training beside it.

    torchrun --nnodes 4 --nproc-per-node 8 ... tools/calibrate_comm.py --backend nccl --out profile.json \\
        --gpt 32,4096,32,32000,4096,1
    sudo python tools/calibrate_comm.py --emulate 2x2 --rate 1gbit --gpt 4,256,4,1024,128,2 --out p.json

``--emulate NxR`` runs N x R gloo ranks on this machine inside the emulated cluster of ``tools/bench_cluster.py``
(one network namespace per node, ``tbf``-limited links; needs root; the namespaces are always removed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

OPS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")
DEFAULT_SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)   # payload bytes (fp32 buffers)


# -- worker side -------------------------------------------------------------------------------------------------
def _run_op(op: str, x, group, size: int):
    import torch
    import torch.distributed as dist

    n = x.numel()
    if op == "reduce_scatter":
        return dist.reduce_scatter_tensor(torch.empty(n // size, dtype=x.dtype, device=x.device), x, group=group)
    if op == "all_gather":
        return dist.all_gather_into_tensor(torch.empty_like(x), x[:n // size].contiguous(), group=group)
    if op == "all_reduce":
        return dist.all_reduce(x, group=group)
    return dist.all_to_all_single(torch.empty_like(x), x, group=group)


_DEVICE = None   # the device of this calibration: scalars travel there (an NCCL group serves only CUDA tensors)


def _sync() -> None:
    import torch
    if _DEVICE is not None and _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)


def _max_over_ranks(v: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([v], dtype=torch.float64, device=_DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _timed(fn, iters: int) -> float:
    """Median seconds of ``fn`` after one warm-up (completed: CUDA work is synchronised), max over ranks."""
    import torch.distributed as dist

    fn()
    _sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return _max_over_ranks(statistics.median(times))


def _pairwise_bytes(op: str, payload: int, size: int) -> float:
    """Bytes one rank sends in a pairwise exchange (the ledger's model) of a ``payload``-byte buffer."""
    share = (size - 1) / size * payload
    return 2 * share if op == "all_reduce" else share


def measure_links(rank: int, world: int, rpn: int, device, sizes, iters: int):
    """Alpha-beta fits per link and collective, the raw samples, and this rank's cross-node group (or None)."""
    import torch
    import torch.distributed as dist

    from megatron_ext.planner.profile import fit_link_cost, steps

    nodes = world // rpn
    node_groups = [dist.new_group(list(range(n * rpn, (n + 1) * rpn))) for n in range(nodes)]
    cross_groups = [dist.new_group([n * rpn + l for n in range(nodes)]) for l in range(rpn)]
    kinds = []
    if rpn > 1:
        kinds.append(("intra", node_groups[rank // rpn], rpn))
    if nodes > 1:
        kinds.append(("inter", cross_groups[rank % rpn], nodes))
    links: Dict[str, Dict[str, dict]] = {}
    samples: Dict[str, list] = {}
    for link, group, size in kinds:
        for op in OPS:
            pts: List[Tuple[float, float, float]] = []
            for payload in sizes:
                numel = max(size, payload // 4 // size * size)
                x = torch.randn(numel, device=device)
                t = _timed(lambda: _run_op(op, x, group, size), iters)
                per_rank = _pairwise_bytes(op, numel * 4, size)
                metric = per_rank if link == "intra" else rpn * per_rank   # inter: the node's NIC carries all
                pts.append((steps(op, size), metric, t))
            fit = fit_link_cost(pts)
            links.setdefault(link, {})[op] = {"alpha_s": fit.alpha_s, "bytes_per_s": fit.bytes_per_s}
            samples[f"{link} {op}"] = pts
    return links, samples, (cross_groups[rank % rpn] if nodes > 1 else None)


def _gpt(shape: str, device, micro_batches: int):
    """(name, forward + backward FLOPs per micro-batch, model, batches) of the GPT ``L,H,heads,V,seq,mb`` on
    ``device``, as pretrain_gpt builds it (the name is the profile's ``compute_by_model`` key)."""
    import torch

    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.planner.model_spec import ModelSpec, gpt_name

    L, H, heads, V, seq, mb = (int(x) for x in shape.split(","))
    torch.manual_seed(1234)
    model = build_gpt_model(L, H, heads, V, seq).to(device)
    batches = [{k: v.to(device) for k, v in synthetic_gpt_batch(mb, seq, V, seed=i).items()}
               for i in range(micro_batches)]
    spec = ModelSpec(gpt_name(L, H), L, H, heads, V, seq)
    return spec.name, spec.flops_per_sequence() * mb, model, batches


def _gpt_fwd_bwd(shape: str, device):
    """(model name, FLOPs per call, a callable running forward + backward of the GPT ``L,H,heads,V,seq,mb``)."""
    import torch

    from megatron_ext.models import gpt_loss_func

    name, flops, model, (batch,) = _gpt(shape, device, 1)

    def fwd_bwd():
        out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        gpt_loss_func(batch["loss_mask"], out)[0].backward()
        if device.type == "cuda":   # this stream only: a collective queued on another one runs on
            torch.cuda.current_stream(device).synchronize()

    fwd_bwd()
    return name, flops, fwd_bwd


def measure_compute(shape: str, device, iters: int) -> Tuple[str, float]:
    """FLOP/s of forward + backward of the GPT ``L,H,heads,V,seq,mb`` on this rank (min over ranks)."""
    name, flops, fwd_bwd = _gpt_fwd_bwd(shape, device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fwd_bwd()
    dt = (time.perf_counter() - t0) / iters
    return name, flops / _max_over_ranks(dt)


STEP_MICRO_BATCHES = 2   # the no_sync pattern's smallest step: one micro-batch accumulates, the last synchronises


def fwd_bwd_from_step(step_s: float, numel: int, micro_batches: int, optimizer_s_per_element: float,
                      grad_s_per_element: float) -> float:
    """Seconds of one micro-batch's forward + backward inside a measured DP-1 training step: what the cost model's
    compute-alone time (``cost.predict``: ``M x (fwd+bwd + grad copy) + optimizer``) must give back. The step's
    other host work (hooks, buffers, the loss, zeroing) is folded into forward + backward, in proportion to FLOPs."""
    rest = numel * optimizer_s_per_element + micro_batches * numel * grad_s_per_element
    return max(step_s - rest, 0.5 * step_s) / micro_batches   # noisy kernel rates never leave less than half


def dp1_training_step(shape: str, device, solo_group, micro_batches: int = STEP_MICRO_BATCHES):
    """(model name, forward + backward FLOPs per micro-batch, parameters, step, flush): the ODO's own training step
    of the GPT ``L,H,heads,V,seq,mb`` at DP 1 (``solo_group``: this rank alone) -- the compute the planner calibrates
    on; ``flush`` waits for the weight gathers the last step launched."""
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx
    from bench_cluster import odo_step

    name, flops, model, batches = _gpt(shape, device, micro_batches)
    ddp = mx.OverlappedDDP(model, mx.OverlapConfig(bucket_size=1_000_000, ranks_per_node=1), dp_group=solo_group)
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-4), ddp)
    numel = sum(p.numel() for p in model.parameters())
    return name, flops, numel, odo_step(ddp, opt, batches), ddp.param_sync.wait_all


def measure_training_step(shape: str, device, iters: int, windows: int, solo_group, optimizer_s_per_element: float,
                          grad_s_per_element: float) -> Tuple[str, float]:
    """FLOP/s of forward + backward as the training step sees it: :func:`dp1_training_step` on every rank at once
    (the processors shared as in training), forward + backward taken from the step by :func:`fwd_bwd_from_step`.
    ``windows`` windows of ``iters`` back-to-back steps timed by :func:`_timed` (the median window, the slowest
    rank's: one window of a shared host can be 25% off)."""
    name, flops, numel, step, _ = dp1_training_step(shape, device, solo_group)

    def window():
        for _ in range(iters):
            step()

    fb = fwd_bwd_from_step(_timed(window, windows) / iters, numel, STEP_MICRO_BATCHES, optimizer_s_per_element,
                           grad_s_per_element)
    return name, flops / fb


SLOWDOWN_ROUNDS = 5      # paired windows (alone, then beside a collective) behind overlap_slowdown's median
SLOWDOWN_OUTLAST = 3.0   # the background's collectives last this many alone-windows: slowdowns up to 2 stay covered


def background_count(window_s: float, collective_s: float, outlast: float = SLOWDOWN_OUTLAST,
                     cap: int = 100_000) -> int:
    """How many collectives of ``collective_s`` each outlast a compute window of ``window_s`` by ``outlast``. Both
    times are maxima over the ranks, so every rank of the group computes the same count (a collective that one rank
    leaves out hangs the others)."""
    return max(2, min(cap, int(outlast * window_s / max(collective_s, 1e-9)) + 1))


def paired_slowdown(alone_s: List[float], beside_s: List[float]) -> float:
    """``overlap_slowdown`` from paired windows: the median over pairs of (beside / alone - 1), never below 0. Each
    pair's two windows are back to back, so the host's drift over the calibration (10-30% on a shared host) lands on
    both halves of a pair rather than between an alone and a beside measurement minutes apart."""
    if len(alone_s) != len(beside_s) or not alone_s:
        raise ValueError(f"paired_slowdown needs the same number (> 0) of alone and beside windows, got "
                         f"{len(alone_s)} and {len(beside_s)}")
    return max(0.0, statistics.median(b / a - 1.0 for a, b in zip(alone_s, beside_s)))


def measure_overlap_slowdown(shape: str, device, iters: int, group, rounds: int = SLOWDOWN_ROUNDS) -> float:
    """The fraction by which forward + backward slows while a large all-reduce runs beside it on ``group`` (this
    rank's cross-node group): what the cost model charges per second a link is busy (``overlap_slowdown``).

    The background runs for the whole window at every link rate: its count comes from the window and one all-reduce
    timed first (the fixed 24 of earlier versions ended 0.4-0.6 s into a 1.2-1.4 s window at 1 Gbit/s, so most of it
    ran alone). Windows alone and beside alternate (:func:`paired_slowdown`). On a GPU the background runs on
    a stream of its own (a blocking collective makes the issuing stream wait: on the compute stream it would take
    turns with the compute instead of running beside it), with a 64 MiB buffer so that its launches stay few.
    Not yet run on a GPU."""
    import torch
    import torch.distributed as dist

    _, _, fwd_bwd = _gpt_fwd_bwd(shape, device)
    x = torch.zeros(1 << (24 if device.type == "cuda" else 18), device=device)   # zeros: sums never overflow
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    one = _timed(lambda: dist.all_reduce(x, group=group), 3)

    def window() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fwd_bwd()
        return _max_over_ranks(time.perf_counter() - t0)

    alone, beside = [], []
    for _ in range(rounds):
        alone.append(window())
        count = background_count(alone[-1], one)

        def loop():
            if side is None:
                for _ in range(count):
                    dist.all_reduce(x, group=group)
                return
            torch.cuda.set_device(device)
            with torch.cuda.stream(side):
                for _ in range(count):
                    dist.all_reduce(x, group=group)
            side.synchronize()

        bg = threading.Thread(target=loop)
        dist.barrier()
        bg.start()
        t0 = time.perf_counter()
        for _ in range(iters):
            fwd_bwd()
        dt = time.perf_counter() - t0
        bg.join()
        beside.append(_max_over_ranks(dt))
    return paired_slowdown(alone, beside)


HOP_PROBES = 400   # small collectives the background thread runs; the same count on every rank


def measure_hop_cpu(shape: str, device, iters: int, group) -> float:
    """Seconds of compute one small collective takes from forward + backward running beside it (mean over ranks).

    On CPU ranks every hop of a reduction or gather costs the cores that compute something besides its bytes:
    gloo's socket calls, the wake-ups of the thread that waits on it, a scheduler switch while more ranks than cores
    are runnable. The background thread runs ``HOP_PROBES`` tiny all-to-alls (the multi-hop backends' collective)
    and stamps each; the cost is the compute time lost over the window divided by the hops completed inside it.
    On GPUs the hops run on their own engines: 0.
    """
    import torch
    import torch.distributed as dist

    if device.type != "cpu":
        return 0.0
    _, _, fwd_bwd = _gpt_fwd_bwd(shape, device)
    n = max(iters, 5)

    def window() -> Tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(n):
            fwd_bwd()
        return t0, time.perf_counter()

    dist.barrier()
    t0, t1 = window()
    alone = t1 - t0
    size = dist.get_world_size(group)
    x, y = torch.zeros(16 * size, device=device), torch.zeros(16 * size, device=device)
    done: List[float] = []

    def probes():
        for _ in range(HOP_PROBES):
            dist.all_to_all_single(y, x, group=group)
            done.append(time.perf_counter())

    bg = threading.Thread(target=probes)
    dist.barrier()
    bg.start()
    t0, t1 = window()
    bg.join()
    hops = sum(t0 <= t <= t1 for t in done)
    cost = max(0.0, (t1 - t0) - alone) / hops if hops else 0.0
    t = torch.tensor([cost], dtype=torch.float64, device=_DEVICE)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def measure_kernels(device) -> float:
    import torch

    from megatron_ext.kernels import dequantize_symmetric, quantize_symmetric

    x = torch.randn(1 << 22, device=device)
    def run():
        codes, scales = quantize_symmetric(x, bits=8, group_size=2048)
        dequantize_symmetric(codes, scales, bits=8, group_size=2048, numel=x.numel())
    t = _timed(run, 3)
    return 2 * 4 * x.numel() / t


def measure_reduce_kernels(device) -> tuple[float, float]:
    """Bytes/s (4 per element read) of qgZ's reductions over two INT4 chunks of 2M elements: (the final
    dequantize-reduce, charged to INT8's requantizing step too; the INT4 dequantize-reduce-requantize, native C on
    AVX-512 CPUs and several times faster)."""
    import torch

    from megatron_ext.kernels import dequantize_reduce, dequantize_reduce_quantize, quantize_symmetric

    rows = [quantize_symmetric(torch.randn(1 << 21, device=device), bits=4, group_size=2048) for _ in range(2)]
    codes, scales = torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])
    read = 4 * 2 * (1 << 21)
    final = _timed(lambda: dequantize_reduce(codes, scales, bits=4, group_size=2048), 3)
    requant = _timed(lambda: dequantize_reduce_quantize(codes, scales, 4, 2048), 3)
    return read / final, read / requant


def codec_hop(x, out) -> None:
    """The codec calls of one quantized hop, as qwZ makes them: quantize ``x`` straight into its wire row, decode the
    rows in place into ``out`` ([1, x.numel()])."""
    import torch

    from megatron_ext.comm.wire import empty_rows
    from megatron_ext.kernels import dequantize_rows, quantize_symmetric

    groups = -(-x.numel() // 2048)
    _, codes, scales = empty_rows(1, groups * 2048, groups, torch.int8, x.device)
    quantize_symmetric(x, bits=8, group_size=2048, out=(codes, scales))
    dequantize_rows(codes, scales, bits=8, group_size=2048, out=out)


def measure_codec_host(device) -> float:
    """GPU: host seconds of one quantized hop's codec calls (:func:`codec_hop`) on a 1M-element shard, launched
    back to back (the device runs the kernels meanwhile). CPU: 0 (the kernels run on the host and are timed in
    kernel_bytes_per_s)."""
    import torch

    from bench_kernels import host_us_per_call

    if device.type != "cuda":
        return 0.0
    x = torch.randn(1 << 20, device=device)
    out = torch.empty(1, x.numel(), device=device)
    us = host_us_per_call(lambda: codec_hop(x, out), lambda: torch.cuda.synchronize(device), calls=20, rounds=5)
    return _max_over_ranks(us * 1e-6)


def measure_optimizer(device) -> float:
    import torch

    p = torch.nn.Parameter(torch.randn(1 << 20, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.Adam([p], lr=1e-4)
    return _timed(opt.step, 3) / p.numel()


def measure_grad_add(device) -> float:
    """Seconds per element of the backward hook's work: a gradient added into its bucket buffer."""
    import torch

    buf, grad = torch.zeros(1 << 22, device=device), torch.randn(1 << 22, device=device)
    return _timed(lambda: buf.add_(grad), 3) / buf.numel()


def measure_launch(group, device) -> float:
    import torch
    import torch.distributed as dist

    x = torch.zeros(1, device=device)
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.all_reduce(x, group=group, async_op=True) for _ in range(50)]
    dt = (time.perf_counter() - t0) / 50
    for w in works:
        w.wait()
    return _max_over_ranks(dt)


def worker(a) -> None:
    """One rank of ``torchrun`` (env://) or of the emulated cluster (file store): calibrate, rank 0 writes."""
    import torch
    import torch.distributed as dist

    if a.store:
        dist.init_process_group(a.backend, init_method=f"file://{a.store}", rank=a.rank, world_size=a.world,
                                timeout=datetime.timedelta(seconds=900))
    else:
        dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = a.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % rpn:
        raise SystemExit(f"--ranks-per-node {rpn} does not divide the world size {world}")
    if a.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % rpn)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    from megatron_ext.compat import enable_cpu_compat
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    enable_cpu_compat()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    out = calibrate(a, rpn, device)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        links = out["links"]
        print(f"wrote {a.out}: " + ", ".join(f"{l} {op} {c['bytes_per_s'] / 1e6:.0f} MB/s + {1e6 * c['alpha_s']:.0f} us"
                                            for l, ops in links.items() for op, c in ops.items()
                                            if op == "all_gather")
              + f"; compute {out['compute_flops'] / 1e9:.1f} GFLOP/s, overlap slowdown {out['overlap_slowdown']:.2f}, "
              f"{1e3 * out['hop_cpu_s']:.2f} ms of compute per hop",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


def calibrate(a, rpn: int, device) -> dict:
    """Every measurement of the module docstring on an initialised world; the profile as JSON (with the samples)."""
    import torch
    import torch.distributed as dist

    from megatron_ext.planner.profile import HardwareProfile, LinkCost

    global _DEVICE
    _DEVICE = device
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else list(DEFAULT_SIZES)
    links, samples, bg_group = measure_links(rank, world, rpn, device, sizes, a.iters)
    solo_group = [dist.new_group([r]) for r in range(world)][rank]   # every rank creates every group
    opt_s = measure_optimizer(device)
    grad_s = measure_grad_add(device)
    compute: Dict[str, float] = {}     # from the DP-1 training step: what the planner predicts with
    alone: Dict[str, float] = {}       # forward + backward only, outside a training step (kept for reference)
    for shape in a.gpt:
        name, alone[name] = measure_compute(shape, device, a.iters)
        compute[name] = measure_training_step(shape, device, a.iters, a.windows, solo_group, opt_s, grad_s)[1]
    slowdown = (measure_overlap_slowdown(a.gpt[0], device, a.iters, bg_group)
                if a.gpt and bg_group is not None else 0.0)
    hop_cpu_s = measure_hop_cpu(a.gpt[0], device, a.iters, bg_group or dist.group.WORLD) if a.gpt else 0.0
    kernel_bps = measure_kernels(device)
    reduce_bps, requant_bps = measure_reduce_kernels(device)
    launch_s = measure_launch(bg_group or dist.group.WORLD, device)
    codec_host_s = measure_codec_host(device)
    first = compute[next(iter(compute))] if compute else 1e11
    if device.type == "cuda":
        mem = torch.cuda.get_device_properties(device).total_memory
    else:
        import psutil
        mem = psutil.virtual_memory().total // rpn
    prof = HardwareProfile(
        name=a.name, source=f"measured by tools/calibrate_comm.py on {datetime.date.today()} ({world} ranks, "
        f"{rpn} per node, {a.backend}{', emulated link ' + a.rate if a.rate else ''})",
        gpus_per_node=rpn, gpu_memory_bytes=int(mem), peak_flops=a.peak_tflops * 1e12 if a.peak_tflops else first,
        compute_flops=first,
        links={l: {op: LinkCost(**c) for op, c in ops.items()} for l, ops in links.items()},
        # gloo's reduce-scatter, all-gather and all-reduce are rings over the group's ranks too: on the emulated
        # 4x2 cluster the nodes' eth0 counters match the ring count (median 1%), not the pairwise one (19%). The
        # inter-node fit is the same either way (one rank per node: both count (G-1)/G of the payload).
        algorithm="ring",
        reduce_scatter_as_all_reduce=a.backend == "gloo",
        kernel_bytes_per_s=kernel_bps, reduce_kernel_bytes_per_s=reduce_bps, requant_kernel_bytes_per_s=requant_bps,
        kernels_on_compute=device.type == "cpu",
        optimizer_s_per_element=opt_s,
        launch_s=launch_s, codec_host_s=codec_host_s, hop_cpu_s=hop_cpu_s, overlap_slowdown=slowdown,
        compute_by_model=compute,
        grad_s_per_element=grad_s,
        intra_on_compute=device.type == "cpu", stores_attention_scores=device.type == "cpu", device=device.type)
    out = prof.to_json()
    out["samples"] = {k: [list(p) for p in v] for k, v in samples.items()}
    out["fwd_bwd_flops_by_model"] = alone   # for reference: forward + backward alone, outside a training step
    return out


# -- emulated cluster --------------------------------------------------------------------------------------------
def add_worker_args(ap: argparse.ArgumentParser) -> None:
    """The hidden flags ``launch_ranks`` passes to a worker rank."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)


def launch_ranks(cluster, script: str, world: int, rpn: int, args: List[str], timeout: float) -> None:
    """Run ``script --worker`` as ``world`` gloo ranks inside the emulated cluster's node namespaces (file store)."""
    with tempfile.TemporaryDirectory(prefix="mx_ranks_") as d:
        store = os.path.join(d, "store")
        procs = []
        try:
            for r in range(world):
                env = ["env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1", f"PYTHONPATH={ROOT}",
                       f"LOCAL_WORLD_SIZE={rpn}"]
                cmd = ["ip", "netns", "exec", cluster.ns(r // rpn), *env, sys.executable, script, "--worker",
                       "--rank", str(r), "--world", str(world), "--store", store, "--ranks-per-node", str(rpn), *args]
                procs.append(subprocess.Popen(cmd))
            deadline = time.monotonic() + timeout
            rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(rcs):
            raise RuntimeError(f"{os.path.basename(script)}: ranks failed with exit codes {rcs}")


def run_emulated(a, argv: List[str]) -> None:
    from bench_cluster import Cluster

    nodes, rpn = (int(x) for x in a.emulate.lower().split("x"))
    cluster = Cluster(nodes, a.rate, a.prefix)
    try:
        launch_ranks(cluster, os.path.abspath(__file__), nodes * rpn, rpn, argv, a.timeout)
    finally:
        cluster.down()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--name", default="calibrated")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE")
    ap.add_argument("--sizes", default="", help="payload bytes, comma-separated (default 64K,1M,4M,16M)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--windows", type=int, default=5,
                    help="windows of --iters training steps for the compute rate; the median window counts")
    ap.add_argument("--gpt", action="append", default=[],
                    help="a GPT shape L,H,heads,vocab,seq,micro_batch to time forward+backward (repeatable)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s per GPU for MFU (default: measured)")
    ap.add_argument("--emulate", default="", help="NODESxRANKS: run inside the emulated cluster (needs root)")
    ap.add_argument("--rate", default="", help="with --emulate: tbf rate of the inter-node links, e.g. 1gbit")
    ap.add_argument("--prefix", default="mxcal", help="with --emulate: namespace name prefix")
    ap.add_argument("--timeout", type=float, default=1800)
    add_worker_args(ap)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.windows < 1 or a.iters < 1:
        build_parser().error(f"--windows and --iters must be at least 1, got {a.windows} and {a.iters}")
    if not a.worker:   # a rank 0 that cannot write would leave the others waiting at the end: check first
        try:
            with open(a.out, "a"):
                pass
        except OSError as e:
            build_parser().error(f"--out {a.out}: not writable ({e})")
    if a.emulate and not a.worker:
        if not a.rate:
            build_parser().error("--emulate needs --rate (e.g. 1gbit)")
        if os.geteuid() != 0:
            build_parser().error("--emulate needs root to create network namespaces")
        drop = {"--emulate", "--prefix", "--timeout"}
        fwd, skip = [], False
        for x in argv:
            if skip:
                skip = False
                continue
            if x.split("=")[0] in drop:
                skip = "=" not in x
                continue
            fwd.append(x)
        run_emulated(a, fwd)
        return 0
    worker(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
