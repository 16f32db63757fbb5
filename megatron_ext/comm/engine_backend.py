"""Backends driven by the progress engine: the same interface, each call submitted to the engine's FIFO.

The inner backend is built over the engine's clone of the topology (its own groups), so every collective it
issues comes from the engine thread; see [Note: progress engine] in progress.py. Called on the engine thread
itself (a stage of a chained work that the engine is running), a wrapper calls the inner backend directly.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .backend import GradReduce, ParamGather, Work
from .progress import ProgressEngine


class _OnEngine:
    """What both wrappers share: the inner backend's identity and alignment, the engine to submit to."""

    def __init__(self, inner, engine: ProgressEngine) -> None:
        super().__init__(inner.topology, inner.ledger, inner.options)
        self.inner = inner
        self.engine = engine
        self.name = inner.name

    @property
    def shard_alignment(self) -> int:
        return self.inner.shard_alignment


class EngineGradReduce(_OnEngine, GradReduce):
    """``inner``'s reduce-scatter and all-reduce, run by ``engine``."""

    @property
    def all_reduce_alignment(self) -> int:
        return self.inner.all_reduce_alignment

    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        return self.engine.submit(lambda: self.inner.reduce_scatter(bucket, out_shard), (bucket, out_shard))

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return self.engine.submit(lambda: self.inner.all_reduce(tensor), (tensor,))


class EngineParamGather(_OnEngine, ParamGather):
    """``inner``'s all-gather, run by ``engine``."""

    def all_gather(self, shard: torch.Tensor, out_bucket: torch.Tensor) -> Work:
        return self.engine.submit(lambda: self.inner.all_gather(shard, out_bucket), (shard, out_bucket))


def submit_with(backend, launch: Callable[[], Work], tensors: Sequence[torch.Tensor] = ()) -> Work:
    """Run ``launch`` on ``backend``'s engine when it has one (a chain of several backend calls as one engine
    work, so its stages advance on the engine thread), else at once."""
    engine = getattr(backend, "engine", None)
    return engine.submit(launch, tensors) if engine is not None else launch()
