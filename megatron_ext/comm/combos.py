"""The backend combinations that reports, benchmarks and convergence tests compare, named once.

A combination is a gradient reduce-scatter backend plus a parameter all-gather backend (and qgZ's bit width); it
knows its pretrain_gpt flags, so every tool labels the same thing the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class BackendCombo:
    label: str
    grad_reduce: str
    param_gather: str
    qgz_bits: int = 4

    def flags(self) -> List[str]:
        """pretrain_gpt / Megatron-LM plug-in flags for this combination."""
        out = ["--grad-reduce", self.grad_reduce, "--param-gather", self.param_gather]
        if self.grad_reduce == "qgz":
            out += ["--qgz-bits", str(self.qgz_bits)]
        return out


COMBOS: Dict[str, BackendCombo] = {c.label: c for c in (
    BackendCombo("plain", "plain", "plain"),
    BackendCombo("ring", "ring", "plain"),   # plain's reduction as NCCL's ring (comm/ring.py): gloo's baseline
    BackendCombo("qwZ", "plain", "qwz"),
    BackendCombo("qwZ+ring", "ring", "qwz"),
    BackendCombo("qgZ INT4", "qgz", "plain", 4),
    BackendCombo("qgZ INT8", "qgz", "plain", 8),
    BackendCombo("ByteGrad", "bytegrad", "plain"),
    BackendCombo("qwZ+qgZ INT4", "qgz", "qwz", 4),
    BackendCombo("qwZ+qgZ INT8", "qgz", "qwz", 8),
    BackendCombo("qwZ+ByteGrad", "bytegrad", "qwz"),
)}


def select_combos(labels: Optional[Sequence[str]] = None) -> List[BackendCombo]:
    """The named combinations (all when ``labels`` is empty); an unknown label is a ValueError listing the choices."""
    if not labels:
        return list(COMBOS.values())
    unknown = [x for x in labels if x not in COMBOS]
    if unknown:
        raise ValueError(f"unknown backend combination(s) {unknown}; choose from {list(COMBOS)}")
    return [COMBOS[x] for x in labels]
