#!/usr/bin/env python
"""The planner's step-time model at the scale of the papers, by simulation, next to their published numbers.

Nothing runs on a cluster: every number is ``megatron_ext.planner.predict`` (or ``solve``) on a named hardware
preset, so the table shows how far the model of the ODO's overlap carries to 384 V100s and 1024 A800s, not how
the ODO performs there. The presets are used as they are (not tuned to the papers).

1. Seed 000 (ZeRO++) Table 2 on 384 GPUs (24 DGX-2 x 16), presets ``dgx2-v100-1ib`` / ``dgx2-v100-8ib``:
   ZeRO-3 (``p=g=o=384``, plain+plain) against ZeRO++ (``p=g=o=384``, hpZ 16, qgZ INT4 + qwZ). The job, which the
   seed states only in part, is modelled as: "1K" / "2K tokens per GPU (i.e. micro batch size)" = one sequence of
   1024 / 2048 tokens per GPU and step (micro-batch 1, one micro-batch: the seed's micro batch *is* the tokens per
   GPU); fp16 weights and fp16 gradient reduction (V100s have no bf16; DeepSpeed reduces in the training dtype);
   full activation recomputation (without it the 138B model's activations alone exceed a 32 GB V100);
   the GPT shapes of ``MODEL_PRESETS`` (assumed: the seed's appendix with the real ones is not in the seed);
   buckets of 40M elements. TFLOPs are printed twice: model FLOPs (Megatron's formula, no recomputation) and
   "hardware" FLOPs counting the recomputed forward (factor 4 instead of 3), the convention of DeepSpeed's
   Megatron examples that the seed's TFLOPs most likely follow.
2. Seed 004 (AMSP) Fig. 11: LLaMA-7B/13B/30B (30B with full recomputation) from 8 to 1024 GPUs on ``dgx-a100``,
   global batch 1024 sequences of 4096 tokens, micro-batch 1 (so ``M = 1024 / GPUs`` micro-batches), bf16 with
   bf16 gradient reduction (as the DeepSpeed baselines reduce in the training dtype; seed 004 does not say what
   AMSP reduces in, and Megatron's fp32 reduction would double every gradient byte). The planner
   searches lossless plans only (seed 004 runs ZeRO++ without quantization); the paper's baselines are predicted
   as plans: ZeRO-1, ZeRO-3, MiCS (``p=g=o=8``, 30B ``16``), ZeRO++ without quantization (ZeRO-3 + hpZ 8), and
   AMSP's own Table IV plan where the ODO can run it. Every plan takes its fastest bucket size of the searched
   list, 40M and 100M elements (10M buckets never won at 1024 GPUs, and at 8 GPUs, with 128 micro-batches, they
   make each ZeRO-3 replay take seconds -- the replay is linear in buckets x micro-batches --: a run with them was
   stopped unfinished after 14 minutes on two busy cores); a plan over the 80 GB cap at every size is printed
   with '!' (the paper's OOM).

    python tools/planner_scale.py --json docs/benchmarks/planner_scale.json

``tests/unit_tests/planner/test_scale_simulation.py`` reruns part of it and checks the numbers equal the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_ext.planner import Candidate, HardwareProfile, Prediction, TrainingSetup, Workload, hardware_preset
from megatron_ext.planner import model_preset, predict, solve
from megatron_ext.planner.cli import workload_from
from planner_scale_papers import (AMSP_30B_32_GPUS_NOTE, AMSP_GLOBAL_BATCH, AMSP_GPUS, AMSP_HARDWARE,
                                  AMSP_MFU_TEXT, AMSP_RECOMPUTE, AMSP_TABLE_IV, ZEROPP_GPUS, ZEROPP_HARDWARE,
                                  ZEROPP_TABLE2)

GIB = 2 ** 30
SEED000_SETUP = TrainingSetup(params_dtype="fp16", grad_reduce_in_fp32=False)
SEED000_BUCKET = 40_000_000
SEED004_SETUP = TrainingSetup(params_dtype="bf16", grad_reduce_in_fp32=False)
SEED004_BUCKETS = (40_000_000, 100_000_000)   # 10M: never the fastest at 1024 GPUs, 4x the buckets to replay
SEQ_FOR_TOKENS = {"1K": 1024, "2K": 2048}
HW_FLOPS_FACTOR = {"full": 4.0 / 3.0, "none": 1.0, "selective": 1.0}


# -- one plan ------------------------------------------------------------------------------------------------
def summary(p: Prediction, wl: Workload, prof: HardwareProfile) -> dict:
    """The numbers the tables and the regression test read from one prediction."""
    return {"label": p.candidate.label, "plan": p.candidate.describe(wl.dp, wl.ranks_per_node),
            "step_s": p.step_s, "compute_s": p.compute_s, "exposed_s": p.exposed_s,
            "mfu": p.mfu(prof), "model_tflops_per_gpu": p.flops_per_gpu / p.step_s / 1e12,
            "hw_tflops_per_gpu": p.flops_per_gpu * HW_FLOPS_FACTOR[wl.recompute] / p.step_s / 1e12,
            "memory_gib": p.memory["total"] / GIB, "fits": p.memory["total"] <= prof.gpu_memory_bytes,
            "wire_gib_per_node": p.wire_bytes_per_node / GIB}


def fastest(cands: Iterable[Candidate], wl: Workload, prof: HardwareProfile) -> dict:
    """The fastest of ``cands`` under the memory cap (bucket sizes of one plan); if none fits, the smallest one,
    marked ``fits: False`` (the paper's OOM)."""
    preds = [predict(c, wl, prof) for c in cands]
    fit = [p for p in preds if p.memory["total"] <= prof.gpu_memory_bytes]
    if fit:
        return summary(min(fit, key=lambda p: p.step_s), wl, prof)
    return summary(min(preds, key=lambda p: p.memory["total"]), wl, prof)


# -- seed 000, Table 2 ---------------------------------------------------------------------------------------
def zeropp_workload(model: str, tokens: str) -> Workload:
    spec = model_preset(model, seq_length=SEQ_FOR_TOKENS[tokens])
    prof = hardware_preset(ZEROPP_HARDWARE["1ib"])
    return workload_from(spec, gpus=ZEROPP_GPUS, gpus_per_node=prof.gpus_per_node, micro_batch=1,
                         global_batch=ZEROPP_GPUS, recompute="full", setup=SEED000_SETUP)


def zeropp_plans(dp: int, rpn: int) -> Tuple[Candidate, Candidate]:
    """ZeRO-3 and ZeRO++ (hpZ = GPUs per node, qgZ INT4, qwZ) as ODO candidates."""
    zero3 = Candidate(dp, dp, dp, bucket_size=SEED000_BUCKET)
    zeropp = Candidate(dp, dp, dp, rpn, "qgz", "qwz", 4, bucket_size=SEED000_BUCKET)
    return zero3, zeropp


def simulate_table2(keys: Optional[Sequence[Tuple[str, str]]] = None) -> List[dict]:
    """One row per (model, tokens per GPU) and link count: both plans' predictions and the paper's numbers."""
    rows = []
    for model, tokens in keys or list(ZEROPP_TABLE2):
        wl = zeropp_workload(model, tokens)
        zero3, zeropp = zeropp_plans(wl.dp, wl.ranks_per_node)
        for i, (links, preset) in enumerate(ZEROPP_HARDWARE.items()):
            prof = hardware_preset(preset)
            base = summary(predict(zero3, wl, prof), wl, prof)
            plus = summary(predict(zeropp, wl, prof), wl, prof)
            pb, pz, ps = ZEROPP_TABLE2[(model, tokens)][i]
            rows.append({"model": model, "tokens_per_gpu": tokens, "links": links, "hardware": preset,
                         "seq_length": wl.spec.seq_length, "micro_batch": wl.micro_batch,
                         "micro_batches": wl.micro_batches, "params_b": wl.spec.num_params / 1e9,
                         "zero3": base, "zeropp": plus, "speedup": base["step_s"] / plus["step_s"],
                         "paper": {"zero3_tflops": pb, "zeropp_tflops": pz, "speedup": ps}})
    return rows


# -- seed 004, Fig. 11 ---------------------------------------------------------------------------------------
def amsp_workload(model: str, gpus: int) -> Workload:
    prof = hardware_preset(AMSP_HARDWARE)
    return workload_from(model_preset(model), gpus=gpus, gpus_per_node=prof.gpus_per_node, micro_batch=1,
                         global_batch=AMSP_GLOBAL_BATCH, recompute=AMSP_RECOMPUTE[model], setup=SEED004_SETUP)


def paper_plans(model: str, dp: int, rpn: int) -> Dict[str, Optional[Tuple[int, int, int, int]]]:
    """The paper's systems as ``(p, g, o, hpz)`` at this DP size; ``None`` where the ODO has no such plan."""
    out: Dict[str, Optional[Tuple[int, int, int, int]]] = {}
    for name, (p, g, o) in AMSP_TABLE_IV[model].items():
        p, g, o = (dp if v is None else min(v, dp) for v in (p, g, o))
        if p > 1 and not p == g == o:
            out[name] = None            # e.g. AMSP 13B: p = g = 4, os = 8 (ZeRO-3 needs p = g = o in the ODO)
        else:
            out[name] = (p, g, o, min(rpn, p) if name == "ZeRO++" else 1)
    out.setdefault("ZeRO-1", (1, 1, dp, 1))
    return out


def simulate_fig11(models: Sequence[str], gpus: Sequence[int], bucket_sizes: Sequence[int] = SEED004_BUCKETS,
                   search: bool = True, log: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Per model and GPU count: the planner's pick (lossless), the paper's plans predicted, the paper's MFUs.
    ``log`` gets one line per finished row (the small GPU counts take minutes)."""
    prof = hardware_preset(AMSP_HARDWARE)
    rows = []
    for model in models:
        for g in gpus:
            wl = amsp_workload(model, g)
            row: dict = {"model": model, "gpus": g, "micro_batches": wl.micro_batches, "recompute": wl.recompute,
                         "params_b": wl.spec.num_params / 1e9}
            if search:
                t0 = time.perf_counter()
                r = solve(wl, prof, allow_quantized=False, bucket_sizes=bucket_sizes)
                row["planner"] = summary(r.best, wl, prof)
                row["planner"]["candidates"] = len(r.ranked) + r.infeasible
                row["search_wall_s"] = time.perf_counter() - t0     # informative, never compared
            plans = {}
            for name, pgoh in paper_plans(model, wl.dp, wl.ranks_per_node).items():
                if pgoh is None:
                    plans[name] = None
                    continue
                plans[name] = fastest([Candidate(*pgoh, bucket_size=b) for b in bucket_sizes], wl, prof)
            row["plans"] = plans
            row["paper_mfu_pct"] = AMSP_MFU_TEXT.get((model, g), {})
            rows.append(row)
            if log:
                log(format_fig11([row], header=False))
    return rows


# -- printing ------------------------------------------------------------------------------------------------
def format_table2(rows: Sequence[dict]) -> str:
    out = ["Seed 000 Table 2 -- ZeRO++ over ZeRO-3 on 384 V100 (24 x 16): predicted vs paper. TFLOPs/GPU: model "
           "(hardware = x4/3, recomputation counted) | paper",
           f"{'model':<9}{'tok':>4}{'IB':>4} {'ZeRO-3 TF mdl/hw':>17}{'paper':>7} {'ZeRO++ TF mdl/hw':>17}"
           f"{'paper':>7} {'speedup':>8}{'paper':>7} {'GiB z3/z++':>11}"]
    for r in rows:
        z, p, pp = r["zero3"], r["zeropp"], r["paper"]
        mem = f"{z['memory_gib']:.0f}{'' if z['fits'] else '!'}/{p['memory_gib']:.0f}{'' if p['fits'] else '!'}"
        out.append(f"{r['model']:<9}{r['tokens_per_gpu']:>4}{r['links']:>4} "
                   f"{z['model_tflops_per_gpu']:>8.1f}/{z['hw_tflops_per_gpu']:<8.1f}{pp['zero3_tflops']:>7.2f} "
                   f"{p['model_tflops_per_gpu']:>8.1f}/{p['hw_tflops_per_gpu']:<8.1f}{pp['zeropp_tflops']:>7.2f} "
                   f"{r['speedup']:>7.2f}x{pp['speedup']:>6.2f}x {mem:>11}")
    out.append("('!' = over the 32 GB of a V100 in the model's memory estimate)")
    return "\n".join(out)


def _mfu(d: Optional[dict]) -> str:
    if d is None:
        return "n/a"
    return f"{100 * d['mfu']:.0f}" + ("" if d["fits"] else "!")


def format_fig11(rows: Sequence[dict], header: bool = True) -> str:
    names = ("ZeRO-1", "ZeRO-3", "MiCS", "ZeRO++", "AMSP")
    out = []
    if header:
        out += ["Seed 004 Fig. 11 -- MFU % on dgx-a100, global batch 1024 x 4096, micro-batch 1: predicted [paper, "
                "where its text gives it]; '!' = over 80 GB, n/a = plan outside the ODO's space",
                f"{'model':<10}{'GPUs':>5}{'M':>4} " + "".join(f"{n:>10}" for n in names)
                + f"  {'planner pick':<35}{'MFU':>4}{'GiB':>6}  plan"]
    for r in rows:
        cells = []
        for n in names:
            paper = r["paper_mfu_pct"].get(n)
            cells.append(f"{_mfu(r['plans'].get(n)) + (f' [{paper:g}]' if paper is not None else ''):>10}")
        pick = r.get("planner")
        tail = (f"  {pick['label']:<35}{100 * pick['mfu']:>4.0f}{pick['memory_gib']:>6.1f}  {pick['plan']}"
                if pick else "")
        out.append(f"{r['model']:<10}{r['gpus']:>5}{r['micro_batches']:>4} " + "".join(cells) + tail)
    if header:
        out.append(f"(paper, 30B at 32 GPUs: {AMSP_30B_32_GPUS_NOTE}. Table IV's AMSP plans: 7B p1.g1.o8, 13B "
                   "p4.g4.o8 -- outside the ODO's space: its ZeRO-3 needs p = g = o --, 30B p8.g8.o8)")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here (docs/benchmarks/planner_scale.json)")
    ap.add_argument("--models", default="llama-7b,llama-13b,llama-30b")
    ap.add_argument("--gpus", default=",".join(str(g) for g in AMSP_GPUS))
    ap.add_argument("--bucket-sizes", default=",".join(str(b) for b in SEED004_BUCKETS))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    table2 = simulate_table2()
    print(format_table2(table2), flush=True)
    buckets = [int(float(x)) for x in a.bucket_sizes.split(",")]
    fig11 = simulate_fig11(a.models.split(","), [int(g) for g in a.gpus.split(",")], buckets,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n" + format_fig11(fig11))
    print(f"\n(simulated in {time.perf_counter() - t0:.0f} s)")
    if a.json:
        doc = {"generated_by": "tools/planner_scale.py", "date": datetime.date.today().isoformat(),
               "seed000": {"setup": {"gpus": ZEROPP_GPUS, "micro_batch": 1, "micro_batches": 1,
                                     "seq_for_tokens": SEQ_FOR_TOKENS, "params_dtype": "fp16",
                                     "grad_reduce_in_fp32": False, "recompute": "full",
                                     "bucket_size": SEED000_BUCKET},
                           "table2": table2},
               "seed004": {"setup": {"hardware": AMSP_HARDWARE, "global_batch": AMSP_GLOBAL_BATCH,
                                     "micro_batch": 1, "recompute": AMSP_RECOMPUTE, "bucket_sizes": buckets,
                                     "params_dtype": "bf16", "grad_reduce_in_fp32": False,
                                     "allow_quantized": False},
                           "fig11": fig11}}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
