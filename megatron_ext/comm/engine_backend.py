"""Gradient backends driven by the progress engine: the same interface, each call submitted to the engine's FIFO.

The inner backend is built over the engine's clone of the topology (its own groups), so every collective it
issues comes from the engine thread; see [Note: progress engine] in progress.py. Called on the engine thread
itself (a stage of a chained work that the engine is running), a wrapper calls the inner backend directly.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .backend import GradReduce, Work
from .progress import ProgressEngine


class EngineGradReduce(GradReduce):
    """``inner``'s reduce-scatter and all-reduce, run by ``engine``. (Weight gathers have no engine wrapper: they
    run on the training thread, see *What runs on it* in the engine's note.)"""

    def __init__(self, inner: GradReduce, engine: ProgressEngine) -> None:
        super().__init__(inner.topology, inner.ledger, inner.options)
        self.inner = inner
        self.engine = engine
        self.name = inner.name

    @property
    def shard_alignment(self) -> int:
        return self.inner.shard_alignment

    @property
    def all_reduce_alignment(self) -> int:
        return self.inner.all_reduce_alignment

    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        return self.engine.submit(lambda: self.inner.reduce_scatter(bucket, out_shard), (bucket, out_shard))

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return self.engine.submit(lambda: self.inner.all_reduce(tensor), (tensor,))


def submit_with(backend, launch: Callable[[], Work], tensors: Sequence[torch.Tensor] = ()) -> Work:
    """Run ``launch`` on ``backend``'s engine when it has one (a chain of several backend calls as one engine
    work, so its stages advance on the engine thread), else at once."""
    engine = getattr(backend, "engine", None)
    return engine.submit(launch, tensors) if engine is not None else launch()
