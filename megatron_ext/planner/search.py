"""The solver: enumerate the plans seed 004's pre-filter admits, predict each, keep the fastest under the memory cap.

[Note: the search space]
Sharding factors are the divisors of the DP size that fit inside a node or span whole nodes (seed 004 eq. 5-7:
``s^0`` divides the ranks per node, ``s^1`` the nodes, and ``s^0 = R`` once ``s^1 > 1``). Per optimizer factor
``o``: gradients ``g in {1, o}`` (eq. ``s_g in {s_p, s_os}``) with full parameters, or ZeRO-3 with
``p = g = o`` (the parameter-sharded plans the ODO runs) and an hpZ size dividing ``gcd(p, ranks per node)``.
Every plan is checked by ``ShardingPlan.resolve`` -- the rules the ODO itself enforces -- so the planner can never
return a plan the ODO would refuse. Backends: the gradient reduction (plain, qgZ INT4/INT8, ByteGrad) matters
only when a stage crosses nodes and the weight gather (plain, qwZ) only when it does; quantized backends are
lossy and searched only when allowed. On a process group whose reduce-scatter is an all-reduce (gloo:
``HardwareProfile.reduce_scatter_as_all_reduce``) the ring reduce-scatter (comm/ring.py, lossless, half the bytes)
is searched beside plain; on NCCL it would be plain's own algorithm with more launches. Bucket sizes come from a
short list (or the user's). The search is
exhaustive: a few hundred to a few thousand candidates, each replayed in milliseconds.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, List, Optional, Sequence, Tuple

from .candidate import Candidate
from .cost import Prediction, Workload, predict
from .profile import HardwareProfile

DEFAULT_BUCKET_SIZES = (10_000_000, 40_000_000, 100_000_000)
GRAD_BACKENDS = (("plain", 4), ("qgz", 4), ("qgz", 8), ("bytegrad", 4))
RING = ("ring", 4)
GATHER_BACKENDS = ("plain", "qwz")


def aligned_factors(dp: int, ranks_per_node: int) -> List[int]:
    """Divisors of ``dp`` that fit inside a node or span whole nodes (seed 004 eq. 5-7)."""
    return [f for f in range(1, dp + 1) if dp % f == 0 and (ranks_per_node % f == 0 or f % ranks_per_node == 0)]


def candidate_plans(dp: int, ranks_per_node: int) -> List[Tuple[int, int, int, int]]:
    """``(param, grad, optim, hpz)`` of every plan the pre-filter and the ODO's rules admit."""
    out = []
    for o in aligned_factors(dp, ranks_per_node):
        for g in sorted({1, o}):
            out.append((1, g, o, 1))
        if o > 1:
            for h in range(1, math.gcd(o, ranks_per_node) + 1):
                if math.gcd(o, ranks_per_node) % h == 0:
                    out.append((o, o, o, h))
    return out


def enumerate_candidates(wl: Workload, *, allow_quantized: bool = False,
                         bucket_sizes: Sequence[int] = DEFAULT_BUCKET_SIZES, ring: bool = False) -> List[Candidate]:
    """``ring``: search the ring reduce-scatter too (a gloo profile, see the module note)."""
    from ..comm import available_grad_reduce, available_param_gather

    dp, rpn = wl.dp, wl.ranks_per_node
    # Only backends this build has (a plan naming a missing one would fail at start-up).
    have_grad, have_gather = set(available_grad_reduce()), set(available_param_gather())
    all_grads = [b for b in GRAD_BACKENDS if b[0] in have_grad]
    all_gathers = [b for b in GATHER_BACKENDS if b in have_gather]
    out = []
    for p, g, o, h in candidate_plans(dp, rpn):
        crosses = o > rpn or (dp // o > 1 and dp > rpn)
        gather_crosses = o > rpn
        grads = all_grads if (allow_quantized and crosses) else all_grads[:1]
        if ring and crosses and RING[0] in have_grad:
            grads = grads[:1] + [RING] + grads[1:]
        gathers = all_gathers if (allow_quantized and gather_crosses) else all_gathers[:1]
        for gr, bits in grads:
            for pg in gathers:
                for b in bucket_sizes:
                    c = Candidate(p, g, o, h, gr, pg, bits, b)
                    try:
                        c.sharding_plan().resolve(dp, rpn, 0)
                    except ValueError:
                        continue
                    out.append(c)
    return out


@dataclasses.dataclass(frozen=True)
class Ranking:
    workload: Workload
    profile: HardwareProfile
    memory_cap: int
    ranked: List[Prediction]             # feasible, fastest first
    infeasible: int                      # candidates over the memory cap
    leanest_bytes: int = 0               # the least memory any candidate needs (what a cap must at least allow)

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            raise ValueError(f"no plan fits in {format_size(self.memory_cap)} per GPU (--gpu-memory): the leanest "
                             f"of {self.infeasible} plans needs {format_size(self.leanest_bytes)}; add "
                             "recomputation, tensor/pipeline parallelism or GPUs, or lower --micro-batch-size")
        return self.ranked[0]

    def reason(self, p: Prediction) -> str:
        """One line: why this candidate ranks where it does."""
        wl = self.workload
        desc = p.candidate.describe(wl.dp, wl.ranks_per_node)
        gb = p.memory["total"] / 2 ** 30
        core = (f"{desc}; exposed comm {1e3 * p.exposed_s:.0f} ms, {p.wire_bytes_per_node / 2 ** 20:.0f} MiB/node "
                f"across nodes, {gb:.1f} GiB")
        if p is self.ranked[0]:
            return core + " -- fastest that fits"
        best = self.ranked[0]
        why = []
        if p.exposed_s > best.exposed_s * 1.05:
            why.append("more exposed communication")
        if p.candidate.bucket_size != best.candidate.bucket_size and abs(p.exposed_s - best.exposed_s) < 1e-3:
            why.append("bucket size")
        if p.memory["total"] < best.memory["total"]:
            why.append(f"saves {(best.memory['total'] - p.memory['total']) / 2 ** 30:.1f} GiB")
        return core + (" -- " + ", ".join(why) if why else "")


def solve(wl: Workload, profile: HardwareProfile, memory_cap: Optional[int] = None, *,
          allow_quantized: bool = False, bucket_sizes: Sequence[int] = DEFAULT_BUCKET_SIZES,
          candidates: Optional[Iterable[Candidate]] = None) -> Ranking:
    """Rank every admissible candidate (or the given ones) by predicted step time under the memory cap.

    ``memory_cap=None`` is the whole device (``profile.gpu_memory_bytes``: what the at-scale simulation compares
    against the papers); the CLI and ``--auto-plan`` pass ``profile.default_memory_cap``, which keeps a reserve."""
    cap = memory_cap if memory_cap is not None else profile.gpu_memory_bytes
    cands = list(candidates) if candidates is not None else enumerate_candidates(
        wl, allow_quantized=allow_quantized, bucket_sizes=bucket_sizes, ring=profile.reduce_scatter_as_all_reduce)
    preds = [predict(c, wl, profile) for c in cands]
    feasible = [p for p in preds if p.memory["total"] <= cap]
    feasible.sort(key=lambda p: (round(p.step_s, 9), p.candidate.lossy, p.memory["total"]))
    leanest = min((p.memory["total"] for p in preds), default=0)
    return Ranking(wl, profile, cap, feasible, len(preds) - len(feasible), leanest)


def format_size(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.1f} MiB"
