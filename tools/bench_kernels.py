#!/usr/bin/env python
"""Throughput of the quantization kernels against this machine's memory-copy bandwidth, measured in the same run.

For each operation and size: GB/s of bytes read + written by the op (its minimal traffic: inputs once, outputs
once) and the ratio to a ``torch`` clone of the same number of bytes (a clone of B/2 bytes reads B/2 and writes B/2;
like the ops it allocates its output) and to a copy into a preallocated buffer (the raw copy bandwidth, without the
allocation and page-fault cost that fresh multi-MB outputs pay on CPU). Timings are the best of --repeat runs
after one warm-up, interleaved with the copies, so that a shared machine's load hits both alike, each after reading
a buffer of twice the last-level cache (:class:`CacheFlush`: inputs come from memory, not from the cache); on a GPU
they are medians timed with CUDA events by ``triton.testing.do_bench`` (L2 cleared before each call), and up to
4M elements each GPU row also reports its host time per call (``host_us_per_call``: kernel launches, allocations and
argument checks, what the training thread pays per call).
On CPU two paths run, timed in the same interleaved loop: the eager torch reference (backend ``torch``) and the same
math compiled by ``torch.compile`` (backend ``compiled``, the default CPU path); with CUDA available the Triton path
runs on the GPU too. Each compiled or Triton row first checks that its output equals the eager torch path's on the
same inputs, bit for bit (the "= torch" column); compiled rows also record their first call's seconds (compilation,
or a load from Inductor's cache) in ``first_call_seconds``.
Prints a table and writes JSON.

Goals, judged on the ratio to the clone: the eager torch path on CPU >= 30% of copy bandwidth (issue 3), the compiled
CPU path >= 50% (issue 14), Triton on a GPU >= 80% (issue 3); the table marks each row. Default sizes 1M..256M
elements on every device. A size whose estimated peak memory
(:func:`estimate_peak_bytes`: 17.5 bytes per fp32 element + 256 MiB, 4.6 GiB at 256M; peak RSS measured at 64M
was within the estimate) exceeds 80% of the memory available now is skipped with a message and listed in the JSON.

    python tools/bench_kernels.py                          # 1M..256M elements
    python tools/bench_kernels.py --sizes 1M,16M --out bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from megatron_ext import kernels as K

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SIZES = "1M,4M,16M,64M,256M"
# issues 3 and 14: fraction of the clone bandwidth each (device, backend) should reach
GOALS = {("cpu", "torch"): 0.30, ("cpu", "compiled"): 0.50, ("cuda", "triton"): 0.80}
MEMORY_HEADROOM = 0.8  # run a size only if its estimated peak fits in this fraction of the available memory
HOST_TIMED_NUMEL = 4 << 20  # GPU sizes whose host time per call is measured too (above, the device time dominates)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


@dataclass
class Row:
    op: str
    device: str
    backend: str
    numel: int
    bytes_moved: int
    seconds: float
    gbps: float
    copy_gbps: float
    ratio: float
    copy_prealloc_gbps: float
    ratio_prealloc: float
    goal: float | None  # fraction of the clone bandwidth the issue asks for; None: no goal for this device/backend
    meets_goal: bool | None
    matches_torch: bool | None = None  # compiled/Triton rows: output bit-identical to the torch path, same inputs
    first_call_seconds: float | None = None  # compiled rows: the first call (compile, or load from Inductor's cache)
    host_us_per_call: float | None = None  # GPU rows up to HOST_TIMED_NUMEL: host time of one call (host_us_per_call)


def judge(device: str, backend: str, ratio: float) -> tuple[float | None, bool | None]:
    """(goal, met) for a row whose throughput is ``ratio`` times the clone bandwidth; (None, None) without a goal."""
    goal = GOALS.get((device, backend))
    return goal, None if goal is None else ratio >= goal


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (Linux), 32 MiB where it cannot be read."""
    sizes = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            sizes.append(parse_size((index / "size").read_text()))  # "1024K", "32768K"
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


class CacheFlush:
    """Reads a buffer of twice the last-level cache before each timed CPU call, so that every op and every copy
    reads its input from memory, as ``do_bench`` clears the L2 on a GPU: without it a 20 MB clone ran 30-47 GB/s
    from run to run, depending on how much of it the L3 still held."""

    def __init__(self) -> None:
        self.buf = torch.ones(max(2 * last_level_cache_bytes(), 64 << 20) // 8, dtype=torch.int64)

    def __call__(self) -> None:
        self.buf.sum()


def time_once(fn: Callable[[], object], device: str, flush: Callable[[], None] | None = None) -> float:
    if flush is not None:
        flush()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def time_cuda(fn: Callable[[], object]) -> float:
    """Median seconds of ``fn`` on the GPU, timed with CUDA events by ``triton.testing.do_bench`` (which also clears
    the L2 cache before every call, so a small size is not timed out of the cache)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def host_us_per_call(fn: Callable[[], object], sync: Callable[[], None], calls: int = 50, rounds: int = 3) -> float:
    """Host microseconds of one call launched back to back with others, never waited for: what the training thread
    pays per kernel call on a GPU (argument checks, allocations, the launch itself). The least of ``rounds`` means
    over ``calls`` calls, ``sync`` between rounds."""
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    sync()
    return best * 1e6


def same_outputs(a: object, b: object) -> bool:
    """Bit-for-bit equality of two ops' outputs (a tensor or a tuple of tensors)."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and
                                    torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def build_ops(numel: int, dtype: torch.dtype, device: str, group: int, nodes: int, rpn: int, stages: int,
              chunk: int) -> list[tuple[str, Callable[[], object], int]]:
    """(name, call, bytes read + written) for every op at this size; inputs are prepared outside the timing."""
    esize = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(numel, device=device).to(dtype)
    ops = []
    for bits in (8, 4):
        codes, scales = K.quantize_symmetric(x, bits=bits, group_size=group)
        cbytes, sbytes = codes.numel(), scales.numel() * 4
        ops.append((f"quantize_int{bits}", lambda b=bits: K.quantize_symmetric(x, bits=b, group_size=group),
                    numel * esize + cbytes + sbytes))
        ops.append((f"dequantize_int{bits}",
                    lambda c=codes, s=scales, b=bits: K.dequantize_symmetric(c, s, bits=b, group_size=group,
                                                                             numel=numel, dtype=dtype),
                    cbytes + sbytes + numel * esize))
    # qgZ, INT4: swizzle + quantize of the whole bucket; intra-node step over D chunks; final step over N chunks
    lay = K.swizzle_layout(numel, 4, group, nodes, rpn, stages)
    ops.append((f"swizzle_quantize_int4({nodes}x{rpn},S={stages})",
                lambda: K.swizzle_quantize(x, 4, group, nodes, rpn, stages),
                numel * esize + lay.stages * lay.world * (lay.chunk_bytes + 4 * lay.chunk_groups)))
    for k, name in ((rpn, "dequantize_reduce_quantize_int4"), (nodes, "dequantize_reduce_int4")):
        per = chunk_numel(numel, k, group)
        src = x if per * k == numel else torch.cat([x, x.new_zeros(per * k - numel)])  # k chunks of whole groups
        c, s = K.quantize_symmetric(src, bits=4, group_size=group)
        c, s = c.view(k, -1), s.view(k, -1)
        read = c.numel() + s.numel() * 4
        if name.startswith("dequantize_reduce_quantize"):
            ops.append((f"{name}(k={k})", lambda c=c, s=s: K.dequantize_reduce_quantize(c, s, 4, group),
                        read + c.shape[1] + s.shape[1] * 4))
        else:
            ops.append((f"{name}(k={k})", lambda c=c, s=s: K.dequantize_reduce(c, s, bits=4, group_size=group),
                        read + per * 4))
    q, mins, maxs = K.quantize_minmax_uint8(x, chunk)
    mm = mins.numel() * 8
    ops.append(("quantize_minmax_uint8", lambda: K.quantize_minmax_uint8(x, chunk), numel * esize + numel + mm))
    ops.append(("dequantize_minmax_uint8",
                lambda: K.dequantize_minmax_uint8(q, mins, maxs, chunk, numel, dtype), numel + mm + numel * esize))
    # ByteGrad's leader: the N received rows (numel / N codes each) decoded, summed and averaged into fp32
    per = numel // nodes
    rows = [K.quantize_minmax_uint8(x[a * per:(a + 1) * per], chunk) for a in range(nodes)]
    rq, rmin, rmax = (torch.stack(t) for t in zip(*rows))
    ops.append((f"dequantize_minmax_reduce(k={nodes})",
                lambda: K.dequantize_minmax_reduce(rq, rmin, rmax, chunk, per, factor=1.0 / (nodes * rpn)),
                rq.numel() + 8 * rmin.numel() + per * 4))
    return ops


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_numel(numel: int, k: int, group: int) -> int:
    """Elements per chunk when the reduce ops' input splits ``numel`` elements into ``k`` chunks of whole groups."""
    return _cdiv(_cdiv(numel, k), group) * group


def estimate_peak_bytes(numel: int, dtype: torch.dtype, group: int, nodes: int, rpn: int) -> int:
    """Peak bytes one size needs: what :func:`build_ops` keeps (x; INT8, INT4, 2 x k-chunk INT4 and 2 x min-max codes:
    the whole tensor's and ByteGrad's rows) plus the largest row: its copy buffers (src + dst = the op's bytes moved)
    and its output (the clone's, half the bytes moved, is smaller). The largest rows are dequantize_int8 (reads codes,
    writes ``dtype``) and the fp32 output of dequantize_reduce over the smaller k. Per-block temporaries of the torch
    path are a few MiB."""
    esize = torch.tensor([], dtype=dtype).element_size()
    kept = numel * esize + numel + numel // 2 + numel + numel + numel
    per = chunk_numel(numel, min(nodes, rpn), group)
    largest_row = max(numel + 2 * numel * esize, min(nodes, rpn) * per // 2 + 2 * 4 * per)
    return kept + largest_row + (256 << 20)


def available_bytes(device: str) -> int:
    """Memory available now: MemAvailable on CPU (Linux), free memory on the GPU."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sizes_that_fit(sizes: list[int], dtype: torch.dtype, available: int, group: int, nodes: int, rpn: int
                   ) -> tuple[list[int], list[dict]]:
    """(sizes to run, skipped sizes and why): a size runs if its estimate fits in MEMORY_HEADROOM * available."""
    run_sizes, skipped = [], []
    for numel in sizes:
        need = estimate_peak_bytes(numel, dtype, group, nodes, rpn)
        if need <= MEMORY_HEADROOM * available:
            run_sizes.append(numel)
        else:
            skipped.append(dict(numel=numel, estimated_peak_bytes=need, available_bytes=available))
    return run_sizes, skipped


def copy_fns(nbytes: int, device: str) -> tuple[Callable[[], object], Callable[[], object], int]:
    """A clone of nbytes/2 bytes (reads and writes nbytes in all, allocating its output like the ops do) and the
    same copy into a preallocated buffer (no allocation / page-fault cost: the machine's raw copy bandwidth)."""
    src = torch.ones(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return src.clone, (lambda: dst.copy_(src)), 2 * src.numel()


def backends_for(device: str) -> list[str]:
    """The paths timed on ``device``: eager torch and compiled on CPU (unless MX_KERNELS forces one), else the
    dispatcher's choice."""
    forced = os.environ.get("MX_KERNELS")
    if device == "cpu" and not forced:
        return ["torch", "compiled"]
    return [K.select_backend(device)]


def _on(backend: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` on ``backend``; compiled at every size (the automatic mode leaves small tensors eager)."""
    from megatron_ext.kernels.compiled import use_compile

    def call():
        with K.use_backend(backend), use_compile("1" if backend == "compiled" else None):
            return fn()
    return call


def run(sizes: list[int], device: str, dtype: torch.dtype, repeat: int, **geom) -> list[Row]:
    rows = []
    flush = CacheFlush() if device == "cpu" else None
    backends = backends_for(device)
    for numel in sizes:
        for name, op, nbytes in build_ops(numel, dtype, device, **geom):
            fns = {b: _on(b, op) for b in backends}
            matches, first = {}, {}
            for b, fn in fns.items():
                if b == "compiled":  # the first call compiles (or loads Inductor's cache): reported, never timed
                    first[b] = time_once(fn, device)
                if b != "torch":  # correct first: the output against the eager torch path's, same inputs
                    want = _on("torch", op)()  # (before the copy buffers exist: two outputs fit the estimate)
                    matches[b] = same_outputs(fn(), want)
                    del want
            clone, copy_, copied = copy_fns(nbytes, device)
            host = {}
            if device == "cuda":  # event-timed medians; the host clock would time launch latency at small sizes
                times = {b: time_cuda(fn) for b, fn in fns.items()}
                tc, tp = time_cuda(clone), time_cuda(copy_)
                if numel <= HOST_TIMED_NUMEL:
                    host = {b: host_us_per_call(fn, torch.cuda.synchronize) for b, fn in fns.items()}
            else:
                for f in (*fns.values(), clone, copy_):  # warm-up: first-touch page faults, Triton compilation
                    time_once(f, device)
                times = {b: float("inf") for b in fns}
                tc, tp = float("inf"), float("inf")
                for _ in range(repeat):  # best of repeat, interleaved so that all see the same machine load
                    for b, fn in fns.items():
                        times[b] = min(times[b], time_once(fn, device, flush))
                    tc = min(tc, time_once(clone, device, flush))
                    tp = min(tp, time_once(copy_, device, flush))
            cp, pp = copied / tc / 1e9, copied / tp / 1e9
            for b, t in times.items():
                gb = nbytes / t / 1e9
                rows.append(Row(name, device, b, numel, nbytes, t, gb, cp, gb / cp, pp, gb / pp,
                                *judge(device, b, gb / cp), matches.get(b), first.get(b), host.get(b)))
                check = "" if b not in matches else f"  {'== torch' if matches[b] else '!= TORCH'}"
                compiled = "" if b not in first else f"  first call {first[b]:.2f} s"
                hosted = "" if b not in host else f"  host {host[b]:.1f} us/call"
                print(f"{name:42s} {device:4s} {b:8s} {_size(numel):>5s} {t * 1e3:9.3f} ms "
                      f"{gb:7.2f} GB/s  clone {cp:7.2f} GB/s {100 * gb / cp:5.0f}%  copy_ {pp:7.2f} GB/s "
                      f"{100 * gb / pp:5.0f}%{check}{compiled}{hosted}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _size(numel: int) -> str:
    return f"{numel / (1 << 20):.0f}M" if numel >= 1 << 20 else f"{numel / (1 << 10):.0f}K"


def format_table(rows: list[Row]) -> list[str]:
    """Markdown table; the goal column marks whether each row reaches the issue's share of the clone bandwidth."""
    goals = ", ".join(f"{b} on {d.upper()} >= {100 * g:.0f}%" for (d, b), g in GOALS.items())
    lines = [f"Goals (issues 3 and 14), as a share of copy bandwidth (clone of the same bytes): {goals}.", "",
             "| op | device | backend | elements | ms | GB/s | clone GB/s | % of clone | goal | copy_ GB/s "
             "| % of copy_ | = torch | host us/call |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "n/a" if r.goal is None else f"{'meets' if r.meets_goal else 'MISSES'} >= {100 * r.goal:.0f}%"
        same = "-" if r.matches_torch is None else ("yes" if r.matches_torch else "NO")
        lines.append(f"| {r.op} | {r.device} | {r.backend} | {_size(r.numel)} | {r.seconds * 1e3:.3f} | "
                     f"{r.gbps:.2f} | {r.copy_gbps:.2f} | {100 * r.ratio:.0f}% | {mark} | {r.copy_prealloc_gbps:.2f} | "
                     f"{100 * r.ratio_prealloc:.0f}% | {same} | "
                     f"{'-' if r.host_us_per_call is None else f'{r.host_us_per_call:.1f}'} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated element counts (default: %(default)s; "
                   "sizes that would not fit in memory are skipped)")
    p.add_argument("--devices", default=None, help="cpu,cuda (default: cpu, plus cuda when available)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--group-size", type=int, default=2048)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=(10 << 20) // 4, help="min-max chunk (ByteGrad: 10 MiB fp32)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="bench_kernels.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    geom = dict(group=args.group_size, nodes=args.nodes, rpn=args.ranks_per_node, stages=args.stages,
                chunk=args.chunk_size)
    rows, skipped = [], []
    dtype = DTYPES[args.dtype]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for device in devices:
        fit, skip = sizes_that_fit(sizes, dtype, available_bytes(device), args.group_size, args.nodes,
                                   args.ranks_per_node)
        for s in skip:
            print(f"skipping {_size(s['numel'])} on {device}: needs ~{s['estimated_peak_bytes'] / 2 ** 30:.1f} GiB, "
                  f"{s['available_bytes'] / 2 ** 30:.1f} GiB available", flush=True)
        skipped += [dict(s, device=device) for s in skip]
        rows += run(fit, device, dtype, args.repeat, **geom)
    print()
    print("\n".join(format_table(rows)))
    meta = dict(torch=torch.__version__, machine=platform.machine(), processor=platform.processor(),
                threads=torch.get_num_threads(), dtype=args.dtype, **geom,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                goals={f"{d}/{b}": g for (d, b), g in GOALS.items()}, goal_basis="ratio to clone bandwidth")
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows], "skipped": skipped}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
