#!/usr/bin/env python
"""Host time of the Triton ops' Python around their launches, measured without a GPU.

Why: on a GPU the kernels run beside the host, so a small bucket's cost is the host time of its codec calls, and
most of that is Python (argument checks, allocations, views; docs/benchmarks/README.md, *Host time per bucket*). Sessions without a
GPU could not see it. Here every Triton launcher of ``megatron_ext.kernels.triton_ops`` is replaced by a no-op, and
each op the quantized backends call per bucket runs on CPU tensors of a bucket's shapes, interleaved: what is left is the Python
a GPU host pays besides the launches themselves (each about 5-6 us through the binary's launcher on an H100 host).
The column ``x empty`` divides by the host time of one ``torch.empty`` call measured in the same run, so hosts of
different speed can be compared. Best of ``--repeat`` rounds of ``--calls`` calls each, the cases interleaved.

    python tools/bench_host_python.py --json host_python.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import timeit
from collections import Counter
from typing import Callable, Dict, Iterator, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402


@contextlib.contextmanager
def stubbed_launchers(module, count: bool = True) -> Iterator[Counter]:
    """Every launcher in ``module`` replaced by a no-op for the ``with`` block, then restored. ``count``: the no-op
    counts its calls (the yielded Counter, by launcher name; the counting costs host time, so timing runs without)."""
    from megatron_ext.kernels.triton_launch import FastLauncher

    saved = {n: getattr(module, n) for n in dir(module) if isinstance(getattr(module, n), FastLauncher)}
    launches: Counter = Counter()

    def stub(name: str) -> Callable[..., None]:
        def launch(*args, **kwargs) -> None:
            launches[name] += 1
        return launch if count else (lambda *args, **kwargs: None)

    try:
        for n in saved:
            setattr(module, n, stub(n))
        yield launches
    finally:
        for n, launcher in saved.items():
            setattr(module, n, launcher)


def launches_per_call(calls: List[Tuple[str, Callable[[], object]]], launches: Counter) -> Dict[str, int]:
    """Triton launches one call of each case makes (what it adds to the Python measured here, on a GPU)."""
    out = {}
    for name, fn in calls:
        launches.clear()
        fn()
        out[name] = sum(launches.values())
    return out


def cases(numel: int, group: int, nodes: int, rpn: int, chunk: int) -> List[Tuple[str, Callable[[], object]]]:
    """(name, call) per op and per-bucket call sequence, on a bucket of ``numel`` fp32 elements."""
    from megatron_ext.comm.wire import empty_rows
    from megatron_ext.kernels import triton_ops as T

    x = torch.randn(numel)
    groups = -(-numel // group)
    _, codes8, scales8 = empty_rows(1, groups * group, groups, torch.int8, x.device)
    decoded = torch.empty(1, numel)

    def qwz_hop() -> None:   # what calibrate_comm.codec_hop times on a GPU: quantize into a wire row, decode the row
        _, c, s = empty_rows(1, groups * group, groups, torch.int8, x.device)
        T.quantize_symmetric(x, bits=8, group_size=group, out=(c, s))
        T.dequantize_rows(c, s, bits=8, group_size=group, out=decoded)

    # qgZ's intra-node step: k = ranks per node chunks of INT4 codes, requantized into a wire row
    shard = numel // (nodes * rpn)
    sgroups = -(-shard // group)
    chunks = torch.zeros(rpn, sgroups * group // 2, dtype=torch.uint8)
    cscales = torch.ones(rpn, sgroups)
    _, c4, s4 = empty_rows(1, sgroups * group // 2, sgroups, torch.uint8, x.device)
    # qgZ's last step: the nodes' partial sums decoded, summed and averaged straight into the gradient shard
    partials, pscales, grad_shard = (torch.zeros(nodes, sgroups * group // 2, dtype=torch.uint8),
                                     torch.ones(nodes, sgroups), torch.empty(shard))
    # ByteGrad: the leader's rows for ``nodes`` nodes ([q | pad | mins | maxs]) and their decode-and-average
    per_node = numel // nodes
    chunk = min(chunk, per_node)
    if per_node % chunk:
        raise SystemExit(f"--chunk {chunk} must divide a node's {per_node} elements (ByteGrad's rows hold whole chunks)")
    per = per_node // chunk
    off = -(-per_node // 4) * 4
    rows = torch.empty(nodes, off + 8 * per, dtype=torch.uint8)
    mm = (rows[:, :per_node], rows[:, off:off + 4 * per].view(torch.float32),
          rows[:, off + 4 * per:off + 8 * per].view(torch.float32))
    return [
        ("torch.empty (the unit)", lambda: torch.empty(1)),
        ("qwZ hop: empty_rows + quantize INT8 out= + dequantize_rows", qwz_hop),
        ("quantize_symmetric INT8, out=", lambda: T.quantize_symmetric(x, bits=8, group_size=group,
                                                                       out=(codes8, scales8))),
        ("dequantize_rows INT8", lambda: T.dequantize_rows(codes8, scales8, bits=8, group_size=group, out=decoded)),
        (f"swizzle_quantize INT4 ({nodes}x{rpn})", lambda: T.swizzle_quantize(x, 4, group, nodes, rpn)),
        (f"dequantize_reduce_quantize INT4, k={rpn}, out=",
         lambda: T.dequantize_reduce_quantize(chunks, cscales, 4, group, out=(c4, s4))),
        (f"dequantize_reduce INT4, k={nodes}, factor=, out=",
         lambda: T.dequantize_reduce(partials, pscales, bits=4, group_size=group, numel=shard,
                                     factor=1.0 / (nodes * rpn), out=grad_shard)),
        (f"quantize_minmax_uint8, {nodes} rows out=", lambda: T.quantize_minmax_uint8(x, chunk, out=mm)),
        (f"dequantize_minmax_reduce, k={nodes}",
         lambda: T.dequantize_minmax_reduce(mm[0], mm[1], mm[2], chunk, per_node, factor=1.0 / nodes)),
        # ByteGrad's all-reduce: the gathered rows decoded into the bucket
        (f"dequantize_minmax_rows, {nodes} rows",
         lambda: T.dequantize_minmax_rows(mm[0], mm[1], mm[2], chunk, out=decoded.view(nodes, per_node))),
    ]


def measure(calls: List[Tuple[str, Callable[[], object]]], number: int, repeat: int) -> Dict[str, float]:
    """Microseconds per call: the least of ``repeat`` rounds, the cases interleaved within each round (a noisy host
    slows them alike)."""
    best = {name: float("inf") for name, _ in calls}
    for _ in range(repeat):
        for name, fn in calls:
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--numel", type=int, default=1 << 20, help="bucket elements (default 1M)")
    ap.add_argument("--group-size", type=int, default=2048)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1 << 18, help="ByteGrad's min-max chunk (elements)")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from megatron_ext.kernels import triton_ops

    calls = cases(a.numel, a.group_size, a.nodes, a.ranks_per_node, a.chunk)
    with stubbed_launchers(triton_ops) as launches:
        count = launches_per_call(calls, launches)
    with stubbed_launchers(triton_ops, count=False):
        us = measure(calls, a.calls, a.repeat)
    unit = us["torch.empty (the unit)"]
    print(f"Python host time per call, Triton launchers stubbed; {a.numel} elements, torch {torch.__version__}"
          f", {platform.processor() or platform.machine()}")
    print(f"{'call':62s} {'us':>8s} {'x empty':>8s} {'launches':>9s}")
    for name, v in us.items():
        print(f"{name:62s} {v:8.1f} {v / unit:8.1f} {count[name]:9d}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                                "machine": platform.machine(), "processor": platform.processor(), **vars(a)},
                       "us_per_call": us, "x_empty": {k: v / unit for k, v in us.items()},
                       "launches_per_call": count}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
