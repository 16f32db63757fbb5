#!/usr/bin/env python
"""Does the planner's ranking match measurement? Calibrate, predict, run, compare -- on the emulated cluster.

For every cluster (``NODESxRANKS:RATE``) it (1) calibrates a profile with ``tools/calibrate_comm.py --emulate``,
(2) lets the planner rank every admissible candidate (plans, quantized backends, bucket sizes) for each GPT shape
and picks ``--plans`` of them -- the planner's first choices and a spread over the rest of its ranking --, (3) runs
them on the same emulated cluster (the ODO on megatron-core GPT, back-to-back steps as ``tools/bench_cluster.py``
times them, in ``--rounds`` rounds that interleave the candidates) and (4) reports predicted against measured step
time: Spearman rank correlation, median absolute error, and how far the planner's first choice is from the measured
best. A table, a JSON and a scatter plot (PNG). As a control for the host's drift between calibration and runs, the
rounds also time the DP-1 training step the calibration takes its compute rate from, and a second summary predicts
with the rate from those rounds.

    sudo python tools/validate_planner.py --clusters 2x2:1gbit,2x2:200mbit,4x2:1gbit,4x2:200mbit \\
        --json docs/benchmarks/planner_validation.json --png docs/benchmarks/planner_validation.png
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

COMPUTE_REF = "compute reference (DP 1)"
DEFAULT_SHAPES = ("4,256,4,1024,128,2", "2,512,8,2048,128,2")   # L,H,heads,vocab,seq,micro-batch


def _shape_args(shape: str) -> argparse.Namespace:
    L, H, heads, V, seq, mb = (int(x) for x in shape.split(","))
    return argparse.Namespace(layers=L, hidden=H, heads=heads, vocab=V, seq=seq, micro_batch=mb)


# -- worker: run candidates --------------------------------------------------------------------------------------
def worker(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx
    from bench_cluster import _add, _gpt_setup, _timed_steps, odo_step
    from calibrate_comm import dp1_training_step
    from megatron_ext.comm import Topology
    from megatron_ext.planner import parse_candidate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=900))
    topo = Topology(ranks_per_node=a.ranks_per_node)
    sa = _shape_args(a.shape)
    sa.micro_batches, sa.iters = a.micro_batches, a.iters
    runs = []
    for label in a.candidates.split(";"):
        cand = parse_candidate(label)
        model, batches = _gpt_setup(sa, topo.rank)
        ddp = mx.OverlappedDDP(model, mx.OverlapConfig(
            bucket_size=cand.bucket_size, sharding=cand.sharding_plan(), grad_reduce=cand.grad_reduce,
            param_gather=cand.param_gather, qgz_bits=cand.qgz_bits, ranks_per_node=topo.ranks_per_node))
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-4), ddp)
        runs.append((label, odo_step(ddp, opt, batches), ddp.param_sync.wait_all))
    # The compute reference, timed in the same rounds: the DP-1 training step calibrate_comm derives its compute
    # rate from, every rank at once. The host's speed drifts by 10-15% over the minutes between calibration and runs.
    solo = [dist.new_group([r]) for r in range(a.world)][a.rank]
    _, _, numel, ref_step, ref_flush = dp1_training_step(a.shape, torch.device("cpu"), solo, a.micro_batches)
    runs.append((COMPUTE_REF, ref_step, ref_flush))
    # Rounds interleave the candidates (A B C .. A B C ..), so a slow minute of the shared host lands on one round of
    # every candidate instead of on all rounds of one; each candidate's step time is the median of its round means
    # (bench_cluster's --repeats, the same bookkeeping).
    rounds: Dict[str, dict] = {}
    for r in range(a.rounds):
        for label, step, flush in runs:
            # A round's first step has no all-gather to overlap (the last round flushed it): a warm-up. The first
            # round takes two, as the first candidate of a process also pays one-time costs (kernel compilation or
            # cache loads, allocator growth) that a single warm-up step did not always absorb.
            sa.warmup = 2 if r == 0 else 1
            _add(rounds, label, _timed_steps(topo, step, flush, sa))
    results = {label: {"step_s": statistics.median(m["times_s"]), "rounds_s": m["times_s"],
                       "wire_per_node": m["wire_per_node"]} for label, m in rounds.items()}
    results[COMPUTE_REF]["numel"] = numel
    if a.rank == 0:
        for label, res in results.items():
            spread = " ".join(f"{1e3 * t:.0f}" for t in res["rounds_s"])
            print(f"    {label:<40} {1e3 * res['step_s']:8.1f} ms   (rounds: {spread})", flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# -- orchestrator ------------------------------------------------------------------------------------------------
def spearman(xs: List[float], ys: List[float]) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(xs, ys).statistic)


def pick(ranked: list, count: int) -> list:
    """The planner's first choices and an even spread over the rest of its ranking (deterministic)."""
    if len(ranked) <= count:
        return list(ranked)
    head = ranked[:3]
    rest = ranked[3:]
    k = count - len(head)
    return head + [rest[round(i * (len(rest) - 1) / (k - 1))] for i in range(k)]


def _workloads(spec: str, a):
    """(shape, workload) per GPT shape for the cluster ``spec`` (``NxR:rate``)."""
    from megatron_ext.planner import TrainingSetup, Workload
    from megatron_ext.planner.model_spec import ModelSpec, gpt_name

    nodes, rpn = (int(x) for x in spec.split(":")[0].lower().split("x"))
    for shape in a.shapes.split(";"):
        sa = _shape_args(shape)
        model = ModelSpec(gpt_name(sa.layers, sa.hidden), sa.layers, sa.hidden, sa.heads, sa.vocab, sa.seq)
        yield shape, Workload(model, nodes * rpn, rpn, sa.micro_batch, a.micro_batches,
                              setup=TrainingSetup(params_dtype="fp32", grad_reduce_in_fp32=True, device="cpu"))


def _profile_path(spec: str, a) -> str:
    topo, rate = spec.split(":")
    return os.path.join(a.workdir, f"profile_{topo.lower()}_{rate}.json")


def _rank(wl, prof, a):
    from megatron_ext.planner import solve

    return solve(wl, prof, allow_quantized=True, bucket_sizes=[int(x) for x in a.bucket_sizes.split(",")])


def _inrun_profile(prof, wl, ref: dict):
    """``prof`` with this model's compute rate taken from the DP-1 step timed in the rounds beside the plans (the
    same derivation as the calibration's, :func:`calibrate_comm.fwd_bwd_from_step`)."""
    from calibrate_comm import fwd_bwd_from_step

    fb = fwd_bwd_from_step(ref["step_s"], ref["numel"], wl.micro_batches, prof.optimizer_s_per_element,
                           prof.grad_s_per_element)
    rate = wl.spec.flops_per_sequence() * wl.micro_batch / fb
    return dataclasses.replace(prof, compute_by_model={**prof.compute_by_model, wl.spec.name: rate})


def _rows(spec: str, wl, prof, a, measured: Dict[str, dict], ref: Optional[dict]) -> List[dict]:
    """One row per measured plan: the profile's prediction and, with the compute reference ``ref``, the prediction
    on the compute rate measured in the rounds (each with that profile's planner rank)."""
    ranking = _rank(wl, prof, a)
    inrun = _rank(wl, _inrun_profile(prof, wl, ref), a) if ref else None
    by_label = {p.candidate.label: p for p in ranking.ranked}
    by_label_inrun = {p.candidate.label: p for p in inrun.ranked} if inrun else {}
    rows = []
    for label, m in measured.items():
        p = by_label[label]
        row = {"cluster": spec, "model": wl.spec.name, "label": label,
               "plan": p.candidate.describe(wl.dp, wl.ranks_per_node), "planner_rank": ranking.ranked.index(p) + 1,
               "predicted_s": p.step_s, "measured_s": m["step_s"], "measured_rounds_s": m.get("rounds_s"),
               "predicted_wire": p.wire_bytes_per_node, "measured_wire": m["wire_per_node"]}
        if inrun:
            q = by_label_inrun[label]
            row.update(predicted_inrun_s=q.step_s, planner_rank_inrun=inrun.ranked.index(q) + 1,
                       compute_ref_step_s=ref["step_s"], compute_ref_numel=ref["numel"])
        rows.append(row)
    return rows


def rescore(rows: List[dict], a) -> List[dict]:
    """The same measurements against this code's predictions, from the profiles in ``--workdir``: a change of the
    cost model is judged on the runs it is meant to explain, without running them again."""
    from megatron_ext.planner import HardwareProfile

    out = []
    for spec in a.clusters.split(","):
        prof = HardwareProfile.load(_profile_path(spec, a))
        for _, wl in _workloads(spec, a):
            mine = [r for r in rows if r["cluster"] == spec and r["model"] == wl.spec.name]
            measured = {r["label"]: {"step_s": r["measured_s"], "rounds_s": r.get("measured_rounds_s"),
                                     "wire_per_node": r["measured_wire"]} for r in mine}
            ref = ({"step_s": mine[0]["compute_ref_step_s"], "numel": mine[0]["compute_ref_numel"]}
                   if mine and "compute_ref_step_s" in mine[0] else None)
            out += _rows(spec, wl, prof, a, measured, ref)
    return out


def validate_cluster(spec: str, a) -> List[dict]:
    from bench_cluster import Cluster
    from calibrate_comm import launch_ranks, main as calibrate
    from megatron_ext.planner import HardwareProfile

    topo, rate = spec.split(":")
    nodes, rpn = (int(x) for x in topo.lower().split("x"))
    prof_path = _profile_path(spec, a)
    if not os.path.exists(prof_path):
        print(f"[{spec}] calibrating", flush=True)
        calibrate(["--emulate", topo, "--rate", rate, "--prefix", a.prefix, "--out", prof_path,
                   "--sizes", "65536,1048576,4194304", "--name", f"emulated {spec}"]
                  + [x for s in a.shapes.split(";") for x in ("--gpt", s)])
    prof = HardwareProfile.load(prof_path)
    rows = []
    cluster = Cluster(nodes, rate, a.prefix)
    try:
        for shape, wl in _workloads(spec, a):
            ranking = _rank(wl, prof, a)
            chosen = pick(ranking.ranked, a.plans)
            labels = [p.candidate.label for p in chosen]
            print(f"[{spec}] {wl.spec.name}: {len(ranking.ranked)} candidates ranked; running {len(labels)}",
                  flush=True)
            with tempfile.TemporaryDirectory(prefix="mx_validate_") as d:
                out = os.path.join(d, "out.json")
                launch_ranks(cluster, os.path.abspath(__file__), wl.dp, rpn,
                             ["--shape", shape, "--candidates", ";".join(labels), "--micro-batches",
                              str(a.micro_batches), "--iters", str(a.iters), "--rounds", str(a.rounds),
                              "--out", out], a.timeout)
                with open(out) as f:
                    measured = json.load(f)
            ref = measured.pop(COMPUTE_REF)
            rows += _rows(spec, wl, prof, a, measured, ref)
    finally:
        cluster.down()
    return rows


PREDICTIONS = (("predicted_s", "planner_rank", "the profile's compute rate"),
               ("predicted_inrun_s", "planner_rank_inrun", "compute rate measured in the rounds"))


def summarize(rows: List[dict], pred: str = "predicted_s", rank: str = "planner_rank") -> Dict[str, dict]:
    out = {}
    for key in sorted({(r["cluster"], r["model"]) for r in rows}):
        rs = [r for r in rows if (r["cluster"], r["model"]) == key]
        pr, meas = [r[pred] for r in rs], [r["measured_s"] for r in rs]
        first = min(rs, key=lambda r: r[rank])
        best = min(meas)
        out[f"{key[0]} {key[1]}"] = {
            "plans": len(rs), "spearman": spearman(pr, meas),
            "median_abs_error": statistics.median(abs(p - m) / m for p, m in zip(pr, meas)),
            "first_choice_over_best": first["measured_s"] / best - 1.0,
            # after --rescore, the new model's first choice may be a plan that was not run: then this row's
            # "first choice" is only its best-ranked measured plan, and the table says so
            "first_choice_ran": first[rank] == 1}
    return out


def overall(rows: List[dict], summary: Dict[str, dict], pred: str) -> dict:
    return {"spearman_min": min(s["spearman"] for s in summary.values()),
            "median_abs_error_all": statistics.median(abs(r[pred] - r["measured_s"]) / r["measured_s"] for r in rows),
            "first_choice_over_best_max": max(s["first_choice_over_best"] for s in summary.values())}


def _predictions(rows: List[dict]):
    """The prediction columns these rows have (runs before the compute reference have the profile's only)."""
    return [p for p in PREDICTIONS if all(p[0] in r for r in rows)]


def render(rows: List[dict], summaries: Dict[str, dict]) -> str:
    preds = _predictions(rows)
    head = "".join(f"{name:>18}{'error':>7}" for name, _ in zip(("predicted ms", "pred. (rounds) ms"), preds))
    lines = [f"{'cluster':<14}{'model':<12}{'#':>3}  {'plan':<40}{'measured ms':>12}" + head]
    for r in rows:
        cols = "".join(f"{1e3 * r[p]:>18.1f}{100 * (r[p] - r['measured_s']) / r['measured_s']:>6.0f}%"
                       for p, _, _ in preds)
        lines.append(f"{r['cluster']:<14}{r['model']:<12}{r['planner_rank']:>3}  {r['label']:<40}"
                     f"{1e3 * r['measured_s']:>12.1f}" + cols)
    for (pred, _, what) in preds:
        lines += ["", f"predicted with {what}:",
                  f"{'cluster / model':<28}{'plans':>6}{'Spearman':>10}{'median |err|':>14}{'1st vs best':>13}"]
        for k, s in summaries[pred].items():
            lines.append(f"{k:<28}{s['plans']:>6}{s['spearman']:>10.2f}{100 * s['median_abs_error']:>13.0f}%"
                         f"{100 * s['first_choice_over_best']:>12.0f}%" + ("" if s["first_choice_ran"] else
                                                                             "  (first choice not run)"))
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preds = _predictions(rows)
    fig, axes = plt.subplots(1, len(preds), figsize=(6 * len(preds), 6), squeeze=False)
    lo = min(1e3 * min([r["measured_s"]] + [r[p] for p, _, _ in preds]) for r in rows) * 0.8
    hi = max(1e3 * max([r["measured_s"]] + [r[p] for p, _, _ in preds]) for r in rows) * 1.2
    for ax, (pred, _, what) in zip(axes[0], preds):
        for key in sorted({(r["cluster"], r["model"]) for r in rows}):
            rs = [r for r in rows if (r["cluster"], r["model"]) == key]
            ax.scatter([1e3 * r["measured_s"] for r in rs], [1e3 * r[pred] for r in rs], label=" ".join(key), s=18)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.plot([lo, hi], [0.8 * lo, 0.8 * hi], "k:", lw=0.6)
        ax.plot([lo, hi], [1.2 * lo, 1.2 * hi], "k:", lw=0.6, label="+-20%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured step time (ms)")
        ax.set_ylabel("planner's predicted step time (ms)")
        ax.set_title(f"predicted with {what}", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Planner vs measurement, emulated cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="2x2:1gbit,2x2:200mbit,4x2:1gbit,4x2:200mbit")
    ap.add_argument("--shapes", default=";".join(DEFAULT_SHAPES),
                    help="GPT shapes L,H,heads,vocab,seq,mb; ';'-separated")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--bucket-sizes", default="250000,1000000")
    ap.add_argument("--plans", type=int, default=8, help="candidates run per cluster and shape")
    ap.add_argument("--iters", type=int, default=3, help="timed back-to-back steps per candidate and round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over the candidates, interleaved; a candidate's time is the median of its rounds")
    ap.add_argument("--workdir", default="planner_validation", help="profiles are kept here (reused if present)")
    ap.add_argument("--prefix", default="mxpv")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default="planner_validation.json")
    ap.add_argument("--png", default="planner_validation.png")
    ap.add_argument("--rescore", action="store_true",
                    help="no runs: this code's predictions for the measurements already in --json (profiles from "
                         "--workdir)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the clusters already in --json (an interrupted run's partial results), run the rest")
    from calibrate_comm import add_worker_args

    add_worker_args(ap)
    ap.add_argument("--ranks-per-node", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--candidates", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.rescore:
        with open(a.json) as f:
            rows = rescore(json.load(f)["rows"], a)
    elif os.geteuid() != 0:
        ap.error("needs root to create network namespaces")
    else:
        os.makedirs(a.workdir, exist_ok=True)
        rows = run_clusters(a)
    return report(rows, a)


def run_clusters(a) -> List[dict]:
    rows: List[dict] = []
    if a.resume and os.path.exists(a.json):
        with open(a.json) as f:
            rows = [r for r in json.load(f)["rows"] if r["cluster"] in a.clusters.split(",")]
    for spec in a.clusters.split(","):
        if any(r["cluster"] == spec for r in rows):
            print(f"[{spec}] kept from {a.json}", flush=True)
            continue
        rows += validate_cluster(spec, a)
        with open(a.json, "w") as f:   # partial results survive an interrupted run
            json.dump({"rows": rows}, f, indent=1)
    return rows


def report(rows: List[dict], a) -> int:
    summaries, totals = {}, {}
    for pred, rank, what in _predictions(rows):
        summaries[pred] = summarize(rows, pred, rank)
        totals[pred] = overall(rows, summaries[pred], pred)
    print(render(rows, summaries))
    for pred, _, what in _predictions(rows):
        o = totals[pred]
        print(f"overall, {what}: Spearman >= {o['spearman_min']:.2f}, median |error| "
              f"{100 * o['median_abs_error_all']:.0f}%, first choice within "
              f"{100 * o['first_choice_over_best_max']:.0f}% of the measured best")
    with open(a.json, "w") as f:
        json.dump({"config": {k: v for k, v in vars(a).items() if k not in ("worker", "rank", "world", "store")},
                   "rows": rows, "summary": summaries["predicted_s"], "overall": totals["predicted_s"],
                   "summary_inrun": summaries.get("predicted_inrun_s"),
                   "overall_inrun": totals.get("predicted_inrun_s")}, f, indent=1)
    try:
        plot(rows, a.png)
    except ImportError:  # the "bench" extra; the results are in the JSON already, and --rescore can plot them later
        print(f"wrote {a.json}; no {a.png}: matplotlib is not installed (pip install -e '.[bench]')")
        return 0
    print(f"wrote {a.json} and {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
