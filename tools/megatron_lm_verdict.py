#!/usr/bin/env python
"""Loss-curve verdicts for tools/megatron_lm_check.sh: parse Megatron-LM training logs and compare two runs.

    python tools/megatron_lm_verdict.py NAME REFERENCE.log OTHER.log [--rtol R] [--first N] [--last N] [--skip N]

Prints one line ``NAME: PASS|FAIL ...`` with the largest relative loss difference over the iterations both logs
have (optionally restricted to ``--first``..``--last``) and exits 0 on PASS, 1 on FAIL, 2 when a log has no loss.
``--rtol 0`` asks for the same printed losses (a resume that must be exact). ``--skip N`` leaves iteration N out:
Megatron-LM does not reset its loss accumulator after the first iteration of a run (``should_reset = not
is_first_iteration`` in ``training_log``), so after a resume at iteration h the line it logs at h + 2 is the mean of
h + 1 and h + 2, whatever the optimizer; the resume checks skip that line.

[Note: the bf16 tolerance]
Megatron-LM's distributed optimizer and the ODO both keep fp32 masters and reduce fp32 gradients, but in other
bucket layouts and orders, so their gradients differ by fp32 rounding; cast to bf16 weights, an element whose master
sits near a rounding boundary flips by one bf16 ulp (2^-8 relative). The loss, computed from bf16 activations,
moves by about the same relative amount, and the two runs then drift like two seeds of the same training. Over the
check's 40 iterations on mock data we accept two bf16 ulps of the loss, 2^-7 = 0.78% (DEFAULT_RTOL); a wrong
reduction (a missing average, a dropped bucket, stale weights) changes the loss by far more within a few steps.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Dict, Optional, Tuple

DEFAULT_RTOL = 2.0 ** -7
_LINE = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*?lm loss:\s*([0-9.eE+-]+)")


def parse_losses(text: str) -> Dict[int, float]:
    """``{iteration: lm loss}`` from Megatron-LM (or pretrain_gpt) log lines; the last line of an iteration wins."""
    out: Dict[int, float] = {}
    for m in _LINE.finditer(text):
        out[int(m.group(1))] = float(m.group(2))
    return out


def compare(ref: Dict[int, float], other: Dict[int, float], rtol: float, first: Optional[int] = None,
            last: Optional[int] = None, skip: Tuple[int, ...] = ()) -> Tuple[bool, float, list]:
    """(passed, largest relative difference, iterations compared)."""
    its = sorted(i for i in set(ref) & set(other) if (first is None or i >= first) and (last is None or i <= last)
                 and i not in skip)
    if not its:
        return False, float("inf"), []
    worst = max(abs(other[i] - ref[i]) / max(abs(ref[i]), 1e-12) for i in its)
    return worst <= rtol, worst, its


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL)
    ap.add_argument("--first", type=int, default=None)
    ap.add_argument("--last", type=int, default=None)
    ap.add_argument("--skip", type=int, action="append", default=[], help="leave this iteration out (repeatable)")
    a = ap.parse_args(argv)
    logs = []
    for path in (a.reference, a.other):
        with open(path, errors="replace") as f:
            logs.append(parse_losses(f.read()))
        if not logs[-1]:
            print(f"{a.name}: FAIL (no 'lm loss' lines in {path})")
            return 2
    ok, worst, its = compare(logs[0], logs[1], a.rtol, a.first, a.last, tuple(a.skip))
    span = f"iterations {its[0]}-{its[-1]}" if its else "no common iterations"
    span += f" without {', '.join(map(str, a.skip))}" if a.skip and its else ""
    print(f"{a.name}: {'PASS' if ok else 'FAIL'} (largest relative loss difference {worst:.2e} over {span}, "
          f"tolerance {a.rtol:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
