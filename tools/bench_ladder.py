#!/usr/bin/env python
"""Benchmark Ladder Residual vs standard vs Desync-4x vs a communication-free upper bound (seed 002, table 2).

Runs gloo worlds of CPU processes (TP=2 and TP=4 by default) and, for each batch size, times a megatron-core GPT
(local spec) built by ``megatron_ext.models.build_gpt_model``:

* prefill: a no-grad forward over ``--seq`` tokens;
* decode:  a no-grad forward of one new token per sequence (the per-token compute and the 2 x layers all-reduces
  of one decode step; megatron's KV-cache path is not used, so attention over the cached prefix is omitted);
* train:   forward + backward of the LM loss over ``--seq`` tokens (no optimizer step).

"upper bound" is the standard model with every tensor-parallel all-reduce replaced by a no-op (wrong numbers,
right compute: the time a perfect overlap could reach). Prints a table with speedups over standard and the fraction
of the upper bound's gain that ladder captures, and writes JSON.

    python tools/bench_ladder.py --tp 2 4 --batch 1 4 16 --out bench_ladder.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = {
    "standard": {},
    "ladder": {"ladder_residual": True},
    "ladder_no_bwd_overlap": {"ladder_residual": True, "ladder_backward_overlap": False},
    "desync4x": {"desync_residual": "4x"},
    "upper_bound": {},  # standard with communication removed
}


class _DoneWork:
    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def no_tp_communication() -> Iterator[None]:
    """Make ``torch.distributed.all_reduce`` a no-op (the communication-free upper bound)."""
    real = dist.all_reduce

    def fake(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return _DoneWork() if async_op else None

    dist.all_reduce = fake
    try:
        yield
    finally:
        dist.all_reduce = real


def _timed(fn: Callable[[], None], comm_free: bool) -> float:
    dist.barrier()
    with (no_tp_communication() if comm_free else contextlib.nullcontext()):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _bench_world(rank: int, world: int, store: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.compat import causal_attention_mask, enable_cpu_compat
    from megatron_ext.models import build_gpt_model

    enable_cpu_compat()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 ffn_hidden_size=4 * args.hidden, vocab_size=args.vocab, seq_length=args.seq)
    models = {name: build_gpt_model(**shape, **kw) for name, kw in VARIANTS.items()}
    results: Dict[str, Dict[str, Dict[str, float]]] = {name: {} for name in VARIANTS}
    for b in args.batch:
        tokens = torch.randint(0, args.vocab, (b, args.seq))
        pos = torch.arange(args.seq).expand(b, -1)
        mask, mask1 = causal_attention_mask(args.seq), causal_attention_mask(1)

        def phases(model):
            def prefill() -> None:
                with torch.no_grad():
                    model(tokens, pos, mask)

            def decode() -> None:
                with torch.no_grad():
                    model(tokens[:, :1], pos[:, :1], mask1)

            def train() -> None:
                model(tokens, pos, mask, labels=tokens).mean().backward()
                model.zero_grad(set_to_none=True)
            return {"prefill": prefill, "decode": decode, "train": train}

        fns = {name: phases(m) for name, m in models.items()}
        for phase, reps in (("prefill", args.reps), ("decode", 3 * args.reps), ("train", args.reps)):
            for name, m in models.items():
                m.train(phase == "train")
            samples: Dict[str, List[float]] = {name: [] for name in VARIANTS}
            # Variants interleaved rep by rep, so load drift on a shared machine hits them all alike.
            for rep in range(reps + 2):
                for name in VARIANTS:
                    t = _timed(fns[name][phase], name == "upper_bound")
                    if rep >= 2:
                        samples[name].append(t)
            for name in VARIANTS:
                t = torch.tensor([statistics.median(samples[name])])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                results[name].setdefault(str(b), {})[phase] = float(t)
    if rank == 0:
        queue.put(results)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run_world(tp: int, args: argparse.Namespace) -> Dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="bench_ladder_"), "store")
    procs = [ctx.Process(target=_bench_world, args=(r, tp, store, args, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    out = queue.get(timeout=args.timeout)
    for p in procs:
        p.join()
    return out


def summarise(all_results: Dict[str, Dict]) -> List[Dict]:
    rows = []
    for tp, res in all_results.items():
        for b in res["standard"]:
            for phase in ("prefill", "decode", "train"):
                std = res["standard"][b][phase]
                ub = res["upper_bound"][b][phase]
                row = {"tp": int(tp), "batch": int(b), "phase": phase}
                for v in VARIANTS:
                    row[f"{v}_ms"] = res[v][b][phase] * 1e3
                    row[f"{v}_speedup"] = std / res[v][b][phase]
                gain = std / ub - 1.0
                row["ladder_fraction_of_upper_bound_gain"] = (std / res["ladder"][b][phase] - 1.0) / gain \
                    if gain > 1e-3 else float("nan")
                rows.append(row)
    return rows


def print_table(rows: List[Dict]) -> None:
    head = (f"{'TP':>3} {'batch':>5} {'phase':>8} | {'standard':>9} {'ladder':>9} {'desync4x':>9} {'upper':>9} ms"
            f" | {'ladder':>6} {'desync':>6} {'upper':>6} x | {'ladder/upper gain':>17}")
    print(head)
    print("-" * len(head))
    for r in rows:
        frac = r["ladder_fraction_of_upper_bound_gain"]
        print(f"{r['tp']:>3} {r['batch']:>5} {r['phase']:>8} | {r['standard_ms']:>9.2f} {r['ladder_ms']:>9.2f} "
              f"{r['desync4x_ms']:>9.2f} {r['upper_bound_ms']:>9.2f}    | {r['ladder_speedup']:>6.2f} "
              f"{r['desync4x_speedup']:>6.2f} {r['upper_bound_speedup']:>6.2f}   | "
              f"{'n/a' if frac != frac else f'{100 * frac:.0f}%':>17}")


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench_ladder.json")
    args = ap.parse_args(argv)
    results = {str(tp): run_world(tp, args) for tp in args.tp}
    rows = summarise(results)
    print_table(rows)
    meta = {k: v for k, v in vars(args).items()}
    meta.update(torch=torch.__version__, cpus=os.cpu_count(), backend="gloo")
    with open(args.out, "w") as f:
        json.dump({"config": meta, "rows": rows, "raw_seconds": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
