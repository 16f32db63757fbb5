#!/usr/bin/env python
"""Per-step communication volume of the ODO's backends, measured by the ledger on a gloo world.

For a model of ``--params`` elements (bf16 gradients and weights by default, so M = 2 * params bytes) cut into
buckets of ``--bucket-size`` elements, on ``--world`` ranks with ``--ranks-per-node`` ranks per simulated node, this
runs one ZeRO-2 step's collectives -- every bucket's gradient reduce-scatter and parameter all-gather -- through each
backend combination on real data and reads the bytes from the communication ledger:

    plain | qwZ | qgZ (INT4) | qgZ (INT8) | qwZ+qgZ (INT4) | ByteGrad | qwZ+ByteGrad

and prints, per combination and collective, the bytes one rank sends (mean over ranks) intra- and inter-node, the
cross-node bytes per node in units of M, and the ratio to plain. Buckets of equal size move equal bytes, so each
distinct bucket size is run once and multiplied by its count (exact, and fast for large models).

Next to it: seed 000's Table 1 (ZeRO-3: 3M -> 0.75M cross-node per step, ring accounting) and its equivalent for
the ODO's ZeRO-2 flow (reduce-scatter + all-gather = 2M plain -> qgZ 0.25M + qwZ 0.5M = 0.75M), with the closed
forms of this ledger's pairwise accounting, their ring equivalents, and why qgZ measures (N-1)/N of the seed's M/Z.

Sharding plans (``--plans zero2,zero1,mics,amsp7b,zero3,zero3hpz``): real ODO steps per plan and combination
(plain, qwZ+qgZ INT4) on a stack of ``--hidden`` x ``--hidden`` linear layers of about ``--params`` elements, with the
per-step cross-node bytes per node (in units of M) and the model-state bytes per rank from ``model.memory_report()``;
then seed 000's Table 1 (ZeRO-3 3M -> ZeRO++ 0.75M) reproduced from the ZeRO-3 rows.

    python tools/comm_report.py --params 20e6 --world 8 --ranks-per-node 4 --json comm_report.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
from collections import Counter, defaultdict
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_ext.comm.combos import select_combos  # noqa: E402

COMBOS = select_combos(["plain", "qwZ", "qgZ INT4", "qgZ INT8", "qwZ+qgZ INT4", "ByteGrad", "qwZ+ByteGrad"])

SEED_TABLE = {
    "zero3": {"fwd_all_gather": [1.0, 0.5], "bwd_all_gather": [1.0, 0.0], "reduce_scatter": [1.0, 0.25],
              "total": [3.0, 0.75]},
    "odo_zero2": {"all_gather": [1.0, 0.5], "reduce_scatter": [1.0, 0.25], "total": [2.0, 0.75]},
}


def bucket_sizes(params: int, bucket_size: int, world: int, align: int) -> Counter:
    """Distinct padded bucket sizes (elements) and their counts; padding like the ODO: P equal aligned shards."""
    sizes: Counter = Counter()
    left = params
    while left > 0:
        b = min(bucket_size, left)
        left -= b
        unit = world * align
        sizes[-(-b // unit) * unit] += 1
    return sizes


def _rank(rank: int, world: int, store: str, args: dict, outdir: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from megatron_ext.comm import BackendOptions, CommLedger, Topology, build_grad_reduce, build_param_gather

    topo = Topology(ranks_per_node=args["ranks_per_node"])
    dtype = getattr(torch, args["dtype"])
    result: Dict[str, dict] = {}
    g = torch.Generator().manual_seed(rank)
    for combo in COMBOS:
        label = combo.label
        opts = BackendOptions(quant_group_size=args["group_size"], qgz_pipeline_stages=args["stages"],
                              qgz_bits=combo.qgz_bits)
        ledger = CommLedger()
        grad_be = build_grad_reduce(combo.grad_reduce, topo, ledger, opts)
        param_be = build_param_gather(combo.param_gather, topo, ledger, opts)
        for numel, count in args["sizes"]:
            n = numel // world
            bucket = torch.randn(numel, generator=g).to(dtype)
            shard = torch.empty(n, dtype=dtype)
            before = ledger.entries()
            grad_be.reduce_scatter(bucket, shard).wait()
            param_be.all_gather(shard, bucket).wait()
            after = ledger.entries()
            # scale this bucket's bytes by the number of buckets of this size
            for name, e in after.items():
                b = before.get(name)
                d_intra = e.intra - (b.intra if b else 0)
                d_inter = e.inter - (b.inter if b else 0)
                d_calls = e.calls - (b.calls if b else 0)
                ledger.record(name, intra=d_intra * (count - 1), inter=d_inter * (count - 1),
                              calls=d_calls * (count - 1))
        result[label] = ledger.summary()
    plans = _measure_plans(args, dtype) if args["plans"] else {}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": topo.node, "local_rank": topo.local_rank, "ledger": result,
                   "plans": plans}, f)
    dist.barrier()
    dist.destroy_process_group()


PLAN_COMBOS = select_combos(["plain", "qwZ+qgZ INT4"])


def _measure_plans(args: dict, dtype: torch.dtype) -> Dict[str, dict]:
    """One ODO step per plan and combination: this rank's ledger and memory report."""
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx
    from megatron_ext import ShardingPlan

    rpn = args["ranks_per_node"]
    presets = {"zero2": ShardingPlan.zero2(), "zero1": ShardingPlan.zero1(), "mics": ShardingPlan.mics(rpn),
               "amsp7b": ShardingPlan.amsp_7b(rpn), "zero3": ShardingPlan.zero3(),
               "zero3hpz": ShardingPlan.zero3(hpz=rpn)}
    h = args["hidden"]
    layers = max(1, round(args["params"] / (h * h)))
    out = {}
    for name in args["plans"]:
        for combo in PLAN_COMBOS:
            torch.manual_seed(0)
            module = torch.nn.Sequential(*[torch.nn.Linear(h, h, bias=False) for _ in range(layers)]).to(dtype)
            cfg = mx.OverlapConfig(bucket_size=args["bucket_size"], sharding=presets[name],
                                   ranks_per_node=args["ranks_per_node"], grad_reduce=combo.grad_reduce,
                                   param_gather=combo.param_gather, qgz_bits=combo.qgz_bits,
                                   quant_group_size=args["group_size"], qgz_pipeline_stages=args["stages"],
                                   grad_reduce_in_fp32=False)
            model = mx.OverlappedDDP(module, cfg)
            opt = mx.OverlappedDistributedOptimizer(
                OptimizerConfig(optimizer="adam", lr=1e-4, bf16=dtype == torch.bfloat16,
                                fp16=dtype == torch.float16), model)
            x = torch.randn(2, h).to(dtype)
            for _ in range(2):   # ZeRO-3 records its schedule in the first step: measure the second
                model.ledger.reset()
                opt.scale_loss(model(x).float().pow(2).mean()).backward()
                model.finish_grad_sync()
                opt.step()
                opt.zero_grad()
            out[f"{name} {combo.label}"] = {"plan": model.plan.describe(), "ledger": model.ledger.summary(),
                                            "memory": model.memory_report(),
                                            "numel": sum(p.numel() for p in module.parameters())}
            del model, opt, module
    return out


def measure(params: int, bucket_size: int, world: int, ranks_per_node: int, dtype: str, group_size: int,
            stages: int, plans: List[str] = (), hidden: int = 1024) -> List[dict]:
    sizes = bucket_sizes(params, bucket_size, world, 64)
    args = dict(ranks_per_node=ranks_per_node, dtype=dtype, group_size=group_size, stages=stages,
                sizes=sorted(sizes.items()), plans=list(plans), hidden=hidden, params=params,
                bucket_size=bucket_size)
    with tempfile.TemporaryDirectory(prefix="mx_comm_report_") as d:
        store = os.path.join(d, "store")
        mp.start_processes(_rank, args=(world, store, args, d), nprocs=world, start_method="spawn", join=True)
        per_rank = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return per_rank


def aggregate(per_rank: List[dict], world: int, ranks_per_node: int, M: float) -> List[dict]:
    nodes = world // ranks_per_node
    rows = []
    for label in (c.label for c in COMBOS):
        colls: Dict[str, Dict[str, float]] = defaultdict(lambda: {"intra": 0.0, "inter": 0.0, "calls": 0})
        for pr in per_rank:
            for name, e in pr["ledger"][label].items():
                if name == "total":
                    continue
                colls[name]["intra"] += e["intra"] / world
                colls[name]["inter"] += e["inter"] / world
                colls[name]["calls"] = max(colls[name]["calls"], e["calls"])
        total_inter = sum(pr["ledger"][label]["total"]["inter"] for pr in per_rank)
        total_intra = sum(pr["ledger"][label]["total"]["intra"] for pr in per_rank)
        rows.append({
            "combo": label,
            "collectives": dict(colls),
            "per_rank_intra_bytes": total_intra / world,
            "per_rank_inter_bytes": total_inter / world,
            "cross_node_bytes_per_node": total_inter / nodes,
            "cross_node_per_node_over_M": total_inter / nodes / M,
        })
    base = rows[0]["cross_node_bytes_per_node"] or 1.0
    for r in rows:
        r["cross_node_vs_plain"] = r["cross_node_bytes_per_node"] / base
    return rows


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def render(rows: List[dict], cfg: dict) -> str:
    P, D = cfg["world"], cfg["ranks_per_node"]
    N = P // D
    out = [f"Per-step communication (one ZeRO-2 step: every bucket reduce-scattered and all-gathered), "
           f"{cfg['params'] / 1e6:.1f}M params in {cfg['dtype']} (M = {_fmt_bytes(cfg['M'])}), "
           f"{P} ranks = {N} nodes x {D}, bucket {cfg['bucket_size'] / 1e6:.1f}M elements, "
           f"quant group {cfg['group_size']}, qgZ stages {cfg['stages']}.",
           "Ledger model: a rank sends B/P to each peer in a reduce-scatter/all-gather of B bytes (pairwise).", ""]
    hdr = f"{'combo':<14} {'collective':<26} {'calls':>5} {'intra/rank':>12} {'inter/rank':>12}"
    out.append(hdr)
    out.append("-" * len(hdr))
    for r in rows:
        for name, e in sorted(r["collectives"].items()):
            out.append(f"{r['combo']:<14} {name:<26} {e['calls']:>5} {_fmt_bytes(e['intra']):>12} "
                       f"{_fmt_bytes(e['inter']):>12}")
    out.append("")
    hdr2 = (f"{'combo':<14} {'intra/rank':>12} {'inter/rank':>12} {'cross-node/node':>16} {'/ M':>7} "
            f"{'vs plain':>9}")
    out.append(hdr2)
    out.append("-" * len(hdr2))
    for r in rows:
        out.append(f"{r['combo']:<14} {_fmt_bytes(r['per_rank_intra_bytes']):>12} "
                   f"{_fmt_bytes(r['per_rank_inter_bytes']):>12} {_fmt_bytes(r['cross_node_bytes_per_node']):>16} "
                   f"{r['cross_node_per_node_over_M']:>7.3f} {r['cross_node_vs_plain']:>9.3f}")
    by = {r["combo"]: r for r in rows}
    M = cfg["M"]

    def per_node(combo: str, *names: str) -> float:
        """Measured cross-node bytes per node of the given collectives, in units of M."""
        colls = by[combo]["collectives"]
        return sum(colls.get(n, {}).get("inter", 0) for n in names) * P / N / M

    rs, ag = per_node("plain", "reduce_scatter"), per_node("plain", "all_gather")
    qgz4, qgz8 = per_node("qgZ INT4", "qgz_inter_all_to_all"), per_node("qgZ INT8", "qgz_inter_all_to_all")
    qwz = per_node("qwZ", "qwz_all_gather")
    bg = per_node("ByteGrad", "bytegrad_inter_all_to_all", "bytegrad_inter_all_gather")
    e = torch.finfo(getattr(torch, cfg["dtype"])).bits // 8
    q8, q4 = 1 / e, 0.5 / e             # INT8 / INT4 codes over the gradient dtype
    pairwise = D * (N - 1) / N          # plain collective, per node, over M
    ring = (P - 1) / P                  # the same collective as a ring: each node boundary crossed once
    to_ring = ring / pairwise
    out += ["",
            f"Cross-node bytes per node per step / M (M = {cfg['dtype']} gradient bytes = weight bytes; N = {N} nodes, "
            f"D = {D} ranks per node, P = {P}):",
            f"  {'':<24} {'measured':>9} {'closed form (ledger)':>28} {'ring-equivalent':>16} {'seed 000':>10}",
            f"  {'plain reduce-scatter':<24} {rs:>9.3f} {'D(N-1)/N = ' + f'{pairwise:.3f}':>28} {rs * to_ring:>16.3f} "
            f"{'M':>10}",
            f"  {'plain all-gather':<24} {ag:>9.3f} {'D(N-1)/N = ' + f'{pairwise:.3f}':>28} {ag * to_ring:>16.3f} "
            f"{'M':>10}",
            f"  {'qwZ all-gather (INT8)':<24} {qwz:>9.3f} {f'D(N-1)/N*{q8:g} = {pairwise * q8:.3f}':>28} "
            f"{qwz * to_ring:>16.3f} {'0.5M':>10}",
            f"  {'qgZ INT4 all-to-all':<24} {qgz4:>9.3f} {f'(N-1)/N*{q4:g} = {(N - 1) / N * q4:.3f}':>28} "
            f"{qgz4:>16.3f} {'M/Z':>10}",
            f"  {'qgZ INT8 all-to-all':<24} {qgz8:>9.3f} {f'(N-1)/N*{q8:g} = {(N - 1) / N * q8:.3f}':>28} "
            f"{qgz8:>16.3f} {'':>10}",
            f"  {'ByteGrad (leaders)':<24} {bg:>9.3f} {f'(N-1)/N*{q8:g} = {(N - 1) / N * q8:.3f}':>28} "
            f"{bg:>16.3f} {'':>10}",
            "  (measured = closed form + fp32 scales and padding)",
            "Accounting: the ledger counts a reduce-scatter / all-gather as a pairwise exchange -- each of a node's D "
            "ranks sends B/P to each of the P-D remote ranks, D(N-1)/N * B per node -- while seed 000 counts a ring, "
            f"which crosses each node boundary once: (P-1)/P * B ~= B. 'ring-equivalent' rescales the pairwise rows "
            f"by (P-1)/P / (D(N-1)/N) = {to_ring:.3f}. All-to-alls (qgZ, ByteGrad) are pairwise in both models and "
            "are not rescaled.",
            "qgZ vs the seed's M/Z: the seed counts everything a node puts into the inter-node all-to-all (M/Z), "
            f"including the 1/N share addressed to itself; only (N-1)/N of it leaves the node, so qgZ INT4 measures "
            f"(N-1)/N * M/Z = {(N - 1) / N * q4:.3f}M per node here (+ scales), reaching the seed's M/Z as N grows.",
            f"ODO (ZeRO-2) step, ring-equivalent: plain reduce-scatter + all-gather = {(rs + ag) * to_ring:.3f}M "
            f"(seed: 2M); qwZ + qgZ INT4 = {qwz * to_ring:.3f} + {qgz4:.3f} = {qwz * to_ring + qgz4:.3f}M "
            f"(seed: 0.5M + 0.25M = 0.75M); ratio {(qwz * to_ring + qgz4) / max((rs + ag) * to_ring, 1e-12):.3f} "
            "(seed: 0.75 / 2 = 0.375; ZeRO-3's 3M -> 0.75M also needs hpZ for the backward all-gather, which the "
            "ZeRO-2 flow does not have)."]
    return "\n".join(out)


def render_plans(per_rank: List[dict], world: int, ranks_per_node: int, elem: int) -> str:
    """Per plan and combination: cross-node bytes per node per step over M, and model-state MB per rank."""
    nodes = world // ranks_per_node
    rows = per_rank[0]["plans"]
    out = ["", f"Sharding plans: one ODO step (M = model bytes in the model dtype), {nodes} nodes x {ranks_per_node}",
           f"{'plan':<22} {'cross-node/node / M':>20} {'intra/rank MiB':>15} {'state MB/rank':>14}  plan"]
    for key, r in rows.items():
        M = r["numel"] * elem
        inter = sum(pr["plans"][key]["ledger"]["total"]["inter"] for pr in per_rank) / nodes
        intra = sum(pr["plans"][key]["ledger"]["total"]["intra"] for pr in per_rank) / world
        state = sum(v for k, v in r["memory"].items() if k != "bucket_pool")
        out.append(f"{key:<22} {inter / M:>20.3f} {intra / 2 ** 20:>15.2f} {state / 1e6:>14.2f}  {r['plan']}")
    return "\n".join(out)


def render_zero3_table(per_rank: List[dict], world: int, ranks_per_node: int, elem: int) -> str:
    """Seed 000 Table 1 by measurement: cross-node bytes per node per step of ZeRO-3 and ZeRO++ (qwZ + hpZ + qgZ)."""
    plans = per_rank[0]["plans"]
    if "zero3 plain" not in plans or "zero3hpz qwZ+qgZ INT4" not in plans:
        return ""
    P, D = world, ranks_per_node
    N = P // D
    to_ring = (P - 1) / P / (D * (N - 1) / N)   # pairwise collective -> ring (see above); all-to-alls unchanged
    M = plans["zero3 plain"]["numel"] * elem

    def per_node(key: str, name: str) -> float:
        return sum(pr["plans"][key]["ledger"].get(name, {}).get("inter", 0) for pr in per_rank) / N / M

    ag = per_node("zero3 plain", "all_gather") * to_ring
    rs = per_node("zero3 plain", "reduce_scatter") * to_ring
    qwz = per_node("zero3hpz qwZ+qgZ INT4", "qwz_all_gather") * to_ring
    hpz = per_node("zero3hpz qwZ+qgZ INT4", "hpz_all_gather")
    qgz = per_node("zero3hpz qwZ+qgZ INT4", "qgz_inter_all_to_all")
    return "\n".join([
        "", f"Seed 000 Table 1 by measurement (one ZeRO-3 step, cross-node bytes per node / M, ring-equivalent; "
        f"{N} nodes x {D}):",
        f"  {'':<28} {'ZeRO-3':>8} {'seed':>6}   {'ZeRO++ (qwZ+hpZ+qgZ INT4)':>26} {'seed':>6}",
        f"  {'forward all-gather':<28} {ag / 2:>8.3f} {'M':>6}   {qwz:>26.3f} {'0.5M':>6}",
        f"  {'backward all-gather':<28} {ag / 2:>8.3f} {'M':>6}   {hpz:>26.3f} {'0':>6}",
        f"  {'gradient reduce-scatter':<28} {rs:>8.3f} {'M':>6}   {qgz:>26.3f} {'0.25M':>6}",
        f"  {'total':<28} {ag + rs:>8.3f} {'3M':>6}   {qwz + hpz + qgz:>26.3f} {'0.75M':>6}",
        "  (measured = closed form: ring (P-1)/P of each plain collective; qwZ INT8 and qgZ INT4 codes plus fp32 "
        "scales; qgZ's all-to-all sends (N-1)/N of its M/4 across nodes, reaching the seed's M/4 as N grows)"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=20e6, help="model parameters (elements)")
    ap.add_argument("--bucket-size", type=float, default=5e6, help="elements per bucket (--ddp-bucket-size)")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--ranks-per-node", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--group-size", type=int, default=2048, help="--quant-group-size")
    ap.add_argument("--stages", type=int, default=2, help="qgZ pipeline stages")
    ap.add_argument("--plans", default="zero2,zero1,mics,amsp7b,zero3,zero3hpz",
                    help="sharding plans measured with a real ODO step ('' to skip): zero2, zero1, mics, amsp7b, "
                    "zero3, zero3hpz (ZeRO-3 with hpZ over a node)")
    ap.add_argument("--hidden", type=int, default=1024, help="width of the linear layers of the plans' model")
    ap.add_argument("--json", default="comm_report.json", help="where to write the JSON result ('' to skip)")
    a = ap.parse_args(argv)
    if a.world % a.ranks_per_node:
        ap.error(f"--ranks-per-node {a.ranks_per_node} must divide --world {a.world}")
    params, bucket = int(a.params), int(a.bucket_size)
    elem = torch.finfo(getattr(torch, a.dtype)).bits // 8
    plans = [p for p in a.plans.split(",") if p]
    per_rank = measure(params, bucket, a.world, a.ranks_per_node, a.dtype, a.group_size, a.stages, plans, a.hidden)
    padded = sum(s * c for s, c in bucket_sizes(params, bucket, a.world, 64).items())
    M = padded * elem
    cfg = dict(params=params, padded_params=padded, bucket_size=bucket, world=a.world,
               ranks_per_node=a.ranks_per_node, dtype=a.dtype, group_size=a.group_size, stages=a.stages, M=M)
    rows = aggregate(per_rank, a.world, a.ranks_per_node, M)
    print(render(rows, cfg))
    if plans:
        print(render_plans(per_rank, a.world, a.ranks_per_node, elem))
        print(render_zero3_table(per_rank, a.world, a.ranks_per_node, elem))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "seed_000_table_1_over_M": SEED_TABLE,
                       "per_rank": per_rank}, f, indent=1)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
