"""One point of the planner's search space: a sharding plan, the two backends and the bucket size.

A candidate is what a user would otherwise type as flags; it knows those flags (``flags()``), its
``ShardingPlan`` and a short, parseable label (``p1.g1.o8.h1 plain+qwz b40M``) that tools use to name runs.
"""
from __future__ import annotations

import dataclasses
import re
from typing import List

from ..optimizer.sharding import ShardingPlan

LOSSLESS = ("plain", "ring")


@dataclasses.dataclass(frozen=True)
class Candidate:
    param: int
    grad: int
    optim: int
    hpz: int = 1
    grad_reduce: str = "plain"       # plain | ring | qgz | bytegrad
    param_gather: str = "plain"      # plain | qwz
    qgz_bits: int = 4
    bucket_size: int = 40_000_000

    @property
    def lossy(self) -> bool:
        return self.grad_reduce not in LOSSLESS or self.param_gather not in LOSSLESS

    def sharding_plan(self) -> ShardingPlan:
        return ShardingPlan(param=self.param, grad=self.grad, optim=self.optim, hpz=self.hpz)

    @property
    def plan_label(self) -> str:
        return f"p{self.param}.g{self.grad}.o{self.optim}.h{self.hpz}"

    @property
    def backend_label(self) -> str:
        gr = f"qgz{self.qgz_bits}" if self.grad_reduce == "qgz" else self.grad_reduce
        return f"{gr}+{self.param_gather}"

    @property
    def label(self) -> str:
        return f"{self.plan_label} {self.backend_label} b{_si(self.bucket_size)}"

    def describe(self, dp: int, ranks_per_node: int) -> str:
        """A plan name a person recognises (ZeRO-1, MiCS, ...) for this DP size."""
        p, g, o = self.param, self.grad, self.optim
        where = "node" if o <= ranks_per_node else f"{o // ranks_per_node} nodes"
        if p > 1:
            name = "ZeRO-3" if p == dp else f"ZeRO-3 in {where}"
            return name + (f" + hpZ {self.hpz}" if self.hpz > 1 else "")
        if o == 1:
            return "DDP (replicated)"
        if g == 1:
            return "ZeRO-1" if o == dp else f"AMSP (optim in {where})"
        return "ZeRO-2" if o == dp else f"ZeRO-2 in {where}, replicated"

    def flags(self) -> List[str]:
        """pretrain_gpt / Megatron-LM plug-in flags that run this candidate."""
        out = ["--param-shard-size", str(self.param), "--grad-shard-size", str(self.grad),
               "--optim-shard-size", str(self.optim)]
        if self.hpz > 1:
            out += ["--hpz-partition-size", str(self.hpz)]
        out += ["--grad-reduce", self.grad_reduce, "--param-gather", self.param_gather]
        if self.grad_reduce == "qgz":
            out += ["--qgz-bits", str(self.qgz_bits)]
        out += ["--ddp-bucket-size", str(self.bucket_size)]
        return out


_LABEL = re.compile(r"^p(\d+)\.g(\d+)\.o(\d+)\.h(\d+)(?: (plain|ring|qgz4|qgz8|bytegrad)\+(plain|qwz))?(?: b(\S+))?$")


def parse_candidate(label: str, bucket_size: int = 40_000_000) -> Candidate:
    """The inverse of ``Candidate.label`` (backends and bucket optional: plain+plain, ``bucket_size``)."""
    m = _LABEL.match(label.strip())
    if not m:
        raise ValueError(f"plan label {label!r} is not of the form "
                         "'p1.g1.o8.h1 [plain|ring|qgz4|qgz8|bytegrad+plain|qwz] [b40M]'")
    p, g, o, h = (int(x) for x in m.group(1, 2, 3, 4))
    gr, pg, b = m.group(5) or "plain", m.group(6) or "plain", m.group(7)
    bits = 8 if gr == "qgz8" else 4
    return Candidate(p, g, o, h, "qgz" if gr.startswith("qgz") else gr, pg, bits,
                     _parse_si(b) if b else bucket_size)


def _si(n: int) -> str:
    for unit, f in (("G", 10 ** 9), ("M", 10 ** 6), ("k", 10 ** 3)):
        if n >= f and n % (f // 1000 or 1) == 0:
            v = n / f
            return f"{v:g}{unit}"
    return str(n)


def _parse_si(s: str) -> int:
    mult = {"G": 10 ** 9, "M": 10 ** 6, "k": 10 ** 3}.get(s[-1])
    return int(round(float(s[:-1]) * mult)) if mult else int(s)
