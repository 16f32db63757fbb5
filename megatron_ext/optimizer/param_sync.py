"""Parameter path: per-bucket all-gather into the ParameterBuffer, waited for by forward pre-hooks.

[Note: no stale reads]
After the optimizer step every bucket's all-gather is launched in forward order. A forward pre-hook on each module
that owns parameters waits only for the buckets of those parameters, so the gathers overlap the forward of
earlier modules. Parameters read by a module that does not own them (a weight passed as an argument, a tied
output layer) are covered too: during the first forward the wrapper records which owners actually ran their
pre-hook, and the buckets of every other parameter are waited for at the root's pre-hook. Anything that writes
or reads weights outside forward (step, state_dict, evaluation helpers) calls ``wait_all()`` first.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch

from ..comm.backend import ParamGather, Work
from .bucketing import Bucket
from .param_buffer import ParameterBuffer


class ParamSync:
    def __init__(self, module: torch.nn.Module, buckets: List[Bucket], param_buffer: ParameterBuffer,
                 backend: ParamGather, rank: int, overlap: bool) -> None:
        self.module = module
        self.buckets = buckets
        self.param_buffer = param_buffer
        self.backend = backend
        self.rank = rank
        self.overlap = overlap
        self._work: Dict[int, Work] = {}
        # Forward order: the bucket holding the earliest-registered parameter first.
        order = {id(p): i for i, p in enumerate(module.parameters())}
        self.forward_order = sorted(buckets, key=lambda b: min(order.get(id(p), 1 << 60) for p in b.params))
        self._owner_buckets: Dict[int, Set[int]] = {}
        for m in module.modules():
            own = {self.param_buffer.locate(p)[0].index for p in m._parameters.values()
                   if p is not None and self._managed(p)}
            if own:
                self._owner_buckets[id(m)] = own
        self._fired: Optional[Set[int]] = set()   # owners seen during the first forward (learning)
        self._root_buckets: Set[int] = set()
        self._handles: List = []
        if overlap:
            self.enable_hooks()

    def _managed(self, p: torch.nn.Parameter) -> bool:
        try:
            self.param_buffer.locate(p)
            return True
        except KeyError:
            return False

    # -- hooks --------------------------------------------------------------------------------------
    def enable_hooks(self) -> None:
        if self._handles:
            return
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_hook, prepend=True))
        self._handles.append(self.module.register_forward_hook(self._root_post_hook))
        for m in self.module.modules():
            if id(m) in self._owner_buckets:
                self._handles.append(m.register_forward_pre_hook(self._make_pre_hook(id(m))))

    def disable_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def hooks_enabled(self) -> bool:
        return bool(self._handles)

    def _root_pre_hook(self, module, args) -> None:
        if self._fired is not None:
            # Still learning which owners run: be safe and wait for everything this time.
            self.wait_all()
            return
        for idx in self._root_buckets:
            self.wait_bucket(idx)

    def _root_post_hook(self, module, args, output) -> None:
        if self._fired is not None:
            fired = self._fired
            self._fired = None
            self._root_buckets = set()
            for mid, idxs in self._owner_buckets.items():
                if mid not in fired:
                    self._root_buckets |= idxs

    def _make_pre_hook(self, mid: int):
        def hook(module, args) -> None:
            if self._fired is not None:
                self._fired.add(mid)
            for idx in self._owner_buckets[mid]:
                self.wait_bucket(idx)
        return hook

    # -- gathers ------------------------------------------------------------------------------------
    def launch(self) -> None:
        """All-gather every bucket (forward order); waited for lazily when hooks are on, eagerly otherwise."""
        self.wait_all()
        for b in self.forward_order:
            self._work[b.index] = self.backend.all_gather(self.param_buffer.shard_view(b, self.rank),
                                                          self.param_buffer.bucket_view(b))
        if not (self.overlap and self.hooks_enabled):
            self.wait_all()

    def wait_bucket(self, idx: int) -> None:
        w = self._work.pop(idx, None)
        if w is not None:
            w.wait()

    def wait_all(self) -> None:
        for b in self.forward_order:
            self.wait_bucket(b.index)

    @property
    def pending(self) -> int:
        return len(self._work)
