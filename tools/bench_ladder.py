#!/usr/bin/env python
"""Benchmark Ladder Residual vs standard vs Desync-4x vs a communication-free upper bound (seed 002, table 2).

Runs gloo worlds of CPU processes (TP=2 and TP=4 by default) and, for each batch size, times a megatron-core GPT
(local spec) built by ``megatron_ext.models.build_gpt_model``:

* prefill: a no-grad forward over ``--seq`` prompt tokens under megatron-core's ``StaticInferenceContext``
  (fills the KV cache; only the last position's logits are computed, as in megatron's generation loop);
* decode:  ``--decode-steps`` single-token forwards right after that prefill, each reading and extending the KV
  cache (median per-step latency);
* train:   one training step: forward + backward of the LM loss over ``--seq`` tokens + an Adam step.

"upper bound" is the standard model with every ``torch.distributed.all_reduce`` replaced by a no-op (wrong
numbers, right compute: the time a perfect overlap could reach). The inference logits' all-gather over TP
(``runtime_gather_output``, the same for every variant) is kept. Prints a table with speedups over standard and
the fraction of the upper bound's gain that ladder captures, and writes JSON.

    python tools/bench_ladder.py --tp 2 4 --batch 1 4 16 --out bench_ladder.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List

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
# ladder_no_bwd_overlap differs from ladder only in backward: timed for training only.
INFERENCE_VARIANTS = [name for name in VARIANTS if name != "ladder_no_bwd_overlap"]


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


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, pos: torch.Tensor,
                mask: torch.Tensor) -> None:
    model(tokens, pos, mask, labels=tokens).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _timed(fn: Callable[[], Any], comm_free: bool) -> float:
    dist.barrier()
    with (no_tp_communication() if comm_free else contextlib.nullcontext()):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _bench_world(rank: int, world: int, store: str, args: argparse.Namespace, results_q) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from megatron.core import parallel_state as ps
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.compat import causal_attention_mask, enable_cpu_compat
    from megatron_ext.models import build_gpt_model

    enable_cpu_compat()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 ffn_hidden_size=4 * args.hidden, vocab_size=args.vocab, seq_length=args.seq + args.decode_steps)
    models = {name: build_gpt_model(**shape, **kw) for name, kw in VARIANTS.items()}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-5) for name, m in models.items()}
    results: Dict[str, Dict[str, Dict[str, float]]] = {name: {} for name in VARIANTS}
    total = args.seq + args.decode_steps
    for b in args.batch:
        tokens = torch.randint(0, args.vocab, (b, total))
        pos = torch.arange(total).expand(b, -1)
        mask = causal_attention_mask(args.seq)
        samples: Dict[str, Dict[str, List[float]]] = {name: {"prefill": [], "decode": [], "train": []}
                                                      for name in VARIANTS}
        # Variants interleaved rep by rep, so load drift on a shared machine hits them all alike; 2 warm-up reps.
        for rep in range(args.reps + 2):
            for name, model in models.items():
                comm_free = name == "upper_bound"
                if name in INFERENCE_VARIANTS:
                    model.eval()
                    ctx = StaticInferenceContext(b, total)
                    with torch.no_grad():
                        t_prefill = _timed(lambda: model(tokens[:, :args.seq], pos[:, :args.seq], mask,
                                                         inference_context=ctx, runtime_gather_output=True),
                                           comm_free)
                        ctx.increment_sequence_len_offset(args.seq)
                        ctx.enable_decode_mode()
                        t_decode = []
                        for t in range(args.seq, total):
                            t_decode.append(_timed(lambda: model(tokens[:, t:t + 1], pos[:, t:t + 1], None,
                                                                 inference_context=ctx, runtime_gather_output=True),
                                                   comm_free))
                            ctx.increment_sequence_len_offset(1)
                    if rep >= 2:
                        samples[name]["prefill"].append(t_prefill)
                        samples[name]["decode"].extend(t_decode)
                model.train()
                t_train = _timed(lambda: _train_step(model, optimizers[name], tokens[:, :args.seq],
                                                     pos[:, :args.seq], mask), comm_free)
                if rep >= 2:
                    samples[name]["train"].append(t_train)
        for name in VARIANTS:
            for phase, values in samples[name].items():
                if values:
                    t = torch.tensor([statistics.median(values)])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    results[name].setdefault(str(b), {})[phase] = float(t)
    if rank == 0:
        results_q.put(results)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run_world(tp: int, args: argparse.Namespace) -> Dict:
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="bench_ladder_"), "store")
    procs = [ctx.Process(target=_bench_world, args=(r, tp, store, args, results_q)) for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    try:
        while True:  # a rank that dies must not leave the parent waiting for the whole timeout
            try:
                out = results_q.get(timeout=1.0)
                break
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"TP={tp} world failed (exit codes {failed}) or timed out")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
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
                    if phase not in res[v][b]:
                        continue
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
    ap.add_argument("--seq", type=int, default=32, help="prompt / training sequence length")
    ap.add_argument("--decode-steps", type=int, default=8, help="KV-cache decode steps after each prefill")
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
