#!/usr/bin/env python
"""Throughput of the quantization kernels against this machine's memory-copy bandwidth, measured in the same run.

For each operation and size: GB/s of bytes read + written by the op (its minimal traffic: inputs once, outputs
once) and the ratio to a ``torch`` clone of the same number of bytes (a clone of B/2 bytes reads B/2 and writes B/2;
like the ops it allocates its output) and to a copy into a preallocated buffer (the raw copy bandwidth, without the
allocation and page-fault cost that fresh multi-MB outputs pay on CPU). Timings are the best of --repeat runs,
interleaved with the copies, so that a shared machine's load hits both alike.
The torch path runs on CPU; with CUDA available the Triton path runs on the GPU too. Prints a table and writes JSON.

    python tools/bench_kernels.py                          # CPU: 1M..64M elements
    python tools/bench_kernels.py --sizes 1M,16M,256M --out bench.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from megatron_ext import kernels as K

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Best of ``repeat`` timed calls after one warm-up: on a shared machine the minimum is the least disturbed."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


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
        per = max(group, (numel // k) // group * group)
        c, s = K.quantize_symmetric(x[:per * k].contiguous(), bits=4, group_size=group)
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
    return ops


def copy_fns(nbytes: int, device: str) -> tuple[Callable[[], object], Callable[[], object], int]:
    """A clone of nbytes/2 bytes (reads and writes nbytes in all, allocating its output like the ops do) and the
    same copy into a preallocated buffer (no allocation / page-fault cost: the machine's raw copy bandwidth)."""
    src = torch.ones(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return src.clone, (lambda: dst.copy_(src)), 2 * src.numel()


def run(sizes: list[int], device: str, dtype: torch.dtype, repeat: int, **geom) -> list[Row]:
    rows = []
    backend = K.select_backend(device)
    for numel in sizes:
        for name, fn, nbytes in build_ops(numel, dtype, device, **geom):
            clone, copy_, copied = copy_fns(nbytes, device)
            t, tc, tp = float("inf"), float("inf"), float("inf")
            for _ in range(repeat):  # interleaved, so all three see the same machine load
                t = min(t, timeit(fn, device, 1))
                tc = min(tc, timeit(clone, device, 1))
                tp = min(tp, timeit(copy_, device, 1))
            cp, pp = copied / tc / 1e9, copied / tp / 1e9
            gb = nbytes / t / 1e9
            rows.append(Row(name, device, backend, numel, nbytes, t, gb, cp, gb / cp, pp, gb / pp))
            print(f"{name:42s} {device:4s} {backend:6s} {numel / (1 << 20):5.0f}M {t * 1e3:9.2f} ms "
                  f"{gb:7.2f} GB/s  clone {cp:7.2f} GB/s {100 * gb / cp:5.0f}%  copy_ {pp:7.2f} GB/s "
                  f"{100 * gb / pp:5.0f}%", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="comma-separated element counts, e.g. 1M,4M,16M,64M,256M "
                   "(default: 1M,4M,16M,64M on CPU; 1M,4M,16M,64M,256M on GPU)")
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
    rows = []
    for device in devices:
        default = "1M,4M,16M,64M" if device == "cpu" else "1M,4M,16M,64M,256M"
        sizes = [parse_size(s) for s in (args.sizes or default).split(",")]
        rows += run(sizes, device, DTYPES[args.dtype], args.repeat, **geom)
    print()
    print("| op | device | backend | elements | ms | GB/s | clone GB/s | % of clone | copy_ GB/s | % of copy_ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.op} | {r.device} | {r.backend} | {r.numel / (1 << 20):.0f}M | {r.seconds * 1e3:.2f} | "
              f"{r.gbps:.2f} | {r.copy_gbps:.2f} | {100 * r.ratio:.0f}% | {r.copy_prealloc_gbps:.2f} | "
              f"{100 * r.ratio_prealloc:.0f}% |")
    meta = dict(torch=torch.__version__, machine=platform.machine(), processor=platform.processor(),
                threads=torch.get_num_threads(), dtype=args.dtype, **geom,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
