#!/usr/bin/env python
"""The ODO's optimizer state saved and loaded the two ways Megatron-LM's plug-in saves it, side by side.

``torch_dist`` (megatron-core dist-checkpointing, model space: every rank writes the blocks of its own pieces, in
parallel, no gather) against ``torch`` (Megatron-LM's legacy flow: ``save_parameter_state`` gathers the canonical
state to DP rank 0, which writes one file; every rank then reads its slices of it). A bf16 megatron-core GPT, one
step taken so that the Adam state exists, at DP ``--world`` on CPU (gloo). For each way: save and load wall time
(the slowest rank; a process's first save and load apart, as they pay one-time costs), the bytes written, and the peak resident memory of DP rank 0 and of the other ranks, each way in
a fresh world of processes so the peaks are its own. The loaded state is checked against the saved one, bit for bit.

    python tools/bench_dist_checkpoint.py --world 4 --layers 8 --hidden 512 --json dist_ckpt.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WAYS = ("torch_dist", "torch")


def _rank(rank: int, world: int, store: str, way: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                                get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                             FullyParallelSaveStrategyWrapper)
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module

    import megatron_ext as mx
    from megatron_ext.compat import enable_cpu_compat
    from megatron_ext.megatron_lm.optimizer_state import MegatronLMOverlappedOptimizer
    from megatron_ext.models.gpt import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.training.initialize import set_seeds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ps.initialize_model_parallel(1, 1)
    enable_cpu_compat()
    set_seeds(1234)
    gpt = build_gpt_model(args.layers, args.hidden, 8, args.vocab, 64, bf16=True)
    module = Float16Module(gpt.config, gpt)
    group = ps.get_data_parallel_group()
    ddp = mx.OverlappedDDP(module, mx.OverlapConfig(), group)
    opt = MegatronLMOverlappedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True), ddp)
    b = synthetic_gpt_batch(1, 64, args.vocab, seed=rank)
    ddp(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).float().mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    want = super(MegatronLMOverlappedOptimizer, opt).state_dict()["params"]
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "dp_cp_group": group}

    def save(ckpt: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if way == "torch_dist":
            os.makedirs(ckpt, exist_ok=True)
            state = {"model": gpt.sharded_state_dict()}
            state["optimizer"] = opt.sharded_state_dict(state, metadata=metadata)
            dist_checkpointing.save({"optimizer": state["optimizer"]}, ckpt,
                                    FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group))
        else:
            opt.save_parameter_state(ckpt)
        dist.barrier()
        return time.perf_counter() - t0

    def load(ckpt: str) -> float:
        t0 = time.perf_counter()
        if way == "torch_dist":
            state = {"model": gpt.sharded_state_dict()}
            state = {"optimizer": opt.sharded_state_dict(state, is_loading=True, metadata=metadata)}
            loaded = dist_checkpointing.load(state, ckpt, FullyParallelLoadStrategyWrapper(
                get_default_load_sharded_strategy(ckpt), group))
            opt.load_state_dict(loaded["optimizer"])
        else:
            opt.load_parameter_state(ckpt)
        dist.barrier()
        return time.perf_counter() - t0

    # (a process's first save and load pay one-time costs -- megatron-core's writer starts a manager process --
    # which a training run pays once: timed apart)
    first_save = save(os.path.join(out, "first"))
    first_load = load(os.path.join(out, "first"))
    ckpt = os.path.join(out, "ckpt")
    save_s = save(ckpt)
    rss_save = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load_s = load(ckpt)
    got = super(MegatronLMOverlappedOptimizer, opt).state_dict()["params"]
    exact = all(torch.equal(got[n][k], e[k]) for n, e in want.items() for k in ("master", "exp_avg", "exp_avg_sq"))
    times = torch.tensor([save_s, load_s, float(not exact), first_save, first_load], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    rss = [None] * world
    dist.all_gather_object(rss, (rss_save, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    if rank == 0:
        size = (sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt) for f in fs)
                if way == "torch_dist" else os.path.getsize(ckpt))
        params = sum(p.numel() for p in gpt.parameters())
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"way": way, "params": params, "save_s": times[0].item(), "load_s": times[1].item(),
                       "first_save_s": times[3].item(), "first_load_s": times[4].item(),
                       "bytes": size, "exact": times[2].item() == 0, "rank0_peak_rss": rss[0][1],
                       "others_peak_rss": max((r[1] for r in rss[1:]), default=0)}, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(way: str, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix=f"bench_dist_ckpt_{way}_", dir=args.dir)
    try:
        mp.start_processes(_rank, args=(args.world, os.path.join(out, "store"), way, args, out), nprocs=args.world,
                           start_method="spawn")
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="DP ranks (processes)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the system's temp)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = [measure(way, args) for way in WAYS]
    mib = 2 ** 20
    print(f"DP {args.world}, {rows[0]['params'] / 1e6:.1f}M parameters (bf16, fp32 main weights and Adam moments)")
    print(f"{'way':<11}{'save s':>9}{'load s':>9}{'1st save s':>12}{'1st load s':>12}{'MiB':>9}{'rank 0 peak MiB':>17}"
          f"{'others peak MiB':>17}  exact")
    for r in rows:
        print(f"{r['way']:<11}{r['save_s']:>9.2f}{r['load_s']:>9.2f}{r['first_save_s']:>12.2f}{r['first_load_s']:>12.2f}"
              f"{r['bytes'] / mib:>9.0f}{r['rank0_peak_rss'] / mib:>17.0f}{r['others_peak_rss'] / mib:>17.0f}"
              f"  {r['exact']}")
    base = rows[1]
    print(f"torch_dist / torch: save {rows[0]['save_s'] / base['save_s']:.2f}x, load "
          f"{rows[0]['load_s'] / base['load_s']:.2f}x, rank 0 peak {rows[0]['rank0_peak_rss'] / base['rank0_peak_rss']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "layers": args.layers, "hidden": args.hidden, "rows": rows}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
