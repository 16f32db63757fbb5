"""ZeRO-3 parameter storage: primary shards, hpZ secondary shards, and full buckets only while they are needed.

[Note: storage]
With a sharding plan's ``param > 1`` a rank keeps, per parameter dtype, one flat *primary* tensor holding its shard
of every bucket (the same shard the optimizer updates; in model dtype). A bucket's full weights exist only while
it is *gathered*: a buffer from a bounded pool, all-gathered from the primary shards of the param group (or from
the hpZ secondary shards inside the node), with every parameter's ``.data`` a view into it. Released, a parameter's
``.data`` is an empty tensor of its dtype: a stray read fails loudly instead of seeing stale values. With hpZ
(``hpz > 1``) the release after forward first copies this rank's slice of the full bucket -- the bucket cut into
``hpz`` equal pieces, piece ``dp_rank % hpz`` -- into a flat *secondary* tensor, valid until the weights change
(optimizer step, state-dict load), when :meth:`invalidate_secondary` drops it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .bucketing import Bucket
from .buffer_pool import BufferPool
from .param_buffer import ParameterBuffer


class ShardedParameterStore:
    def __init__(self, full: ParameterBuffer, buckets: List[Bucket], shard_rank: int, hpz: int, hpz_rank: int,
                 pool_size: int) -> None:
        self.buckets = buckets
        self.shard_rank = shard_rank
        self.hpz, self.hpz_rank = hpz, hpz_rank
        self._where = full._where
        self._shapes: Dict[int, torch.Size] = {id(p): p.shape for b in buckets for p in b.params}
        device = next(iter(full.flat.values())).device
        self._primary: Dict[int, torch.Tensor] = {}
        self._secondary: Dict[int, torch.Tensor] = {}
        self.flat: Dict[torch.dtype, torch.Tensor] = {}
        self.secondary_flat: Dict[torch.dtype, torch.Tensor] = {}
        for dt in full.flat:
            mine = [b for b in buckets if b.dtype == dt]
            self.flat[dt] = torch.empty(sum(b.shard_numel for b in mine), dtype=dt, device=device)
            if hpz > 1:
                self.secondary_flat[dt] = torch.empty(sum(b.numel // hpz for b in mine), dtype=dt, device=device)
            off = soff = 0
            for b in mine:
                self._primary[b.index] = self.flat[dt][off:off + b.shard_numel]
                self._primary[b.index].copy_(full.shard_view(b, shard_rank))
                off += b.shard_numel
                if hpz > 1:
                    self._secondary[b.index] = self.secondary_flat[dt][soff:soff + b.numel // hpz]
                    soff += b.numel // hpz
        self.secondary_valid = [False] * len(buckets)
        self.pools: Dict[torch.dtype, BufferPool] = {
            dt: BufferPool(pool_size, max(b.numel for b in buckets if b.dtype == dt), dt, device) for dt in self.flat}
        self._full: List[Optional[torch.Tensor]] = [None] * len(buckets)
        self._empty = {dt: torch.empty(0, dtype=dt, device=device) for dt in self.flat}
        for b in buckets:
            self._set_empty(b)

    # -- views --------------------------------------------------------------------------------------------------
    def shard_view(self, b: Bucket, rank: int) -> torch.Tensor:
        """This rank's primary shard of ``b`` (other ranks' shards are not held)."""
        if rank != self.shard_rank:
            raise ValueError(f"rank {self.shard_rank} holds only its own shard of bucket {b.index}, not {rank}'s")
        return self._primary[b.index]

    def secondary_view(self, b: Bucket) -> torch.Tensor:
        return self._secondary[b.index]

    def bucket_view(self, b: Bucket) -> torch.Tensor:
        full = self._full[b.index]
        if full is None:
            raise RuntimeError(f"bucket {b.index} is not gathered")
        return full

    def locate(self, p: torch.nn.Parameter) -> Tuple[Bucket, int]:
        return self._where[id(p)]

    def numel(self) -> int:
        return sum(t.numel() for t in self.flat.values())

    # -- gathered buckets -----------------------------------------------------------------------------------------
    def is_gathered(self, idx: int) -> bool:
        return self._full[idx] is not None

    def acquire(self, b: Bucket) -> torch.Tensor:
        """A pooled buffer for ``b``'s full weights (contents undefined until a gather fills it)."""
        return self.pools[b.dtype].acquire(b.numel, zero=False)

    def materialize(self, b: Bucket, full: torch.Tensor) -> None:
        """Point every parameter of ``b`` into the gathered ``full`` buffer."""
        self._full[b.index] = full
        for p, off in zip(b.params, b.offsets):
            shape = self._shapes[id(p)]
            p.data = full[off:off + _numel(shape)].view(shape)

    def keep_secondary(self, b: Bucket) -> None:
        """Copy this rank's hpZ piece of the gathered bucket (before it is released after forward)."""
        if self.hpz > 1 and not self.secondary_valid[b.index]:
            m = b.numel // self.hpz
            self._secondary[b.index].copy_(self.bucket_view(b)[self.hpz_rank * m:(self.hpz_rank + 1) * m])
            self.secondary_valid[b.index] = True

    def release(self, b: Bucket, buffer: Optional[torch.Tensor] = None) -> None:
        full = self._full[b.index] if buffer is None else buffer
        self._full[b.index] = None
        self._set_empty(b)
        if full is not None:
            self.pools[b.dtype].release(full)

    def write_back(self, b: Bucket) -> None:
        """The gathered bucket's values become this rank's primary shard (after a load into the full weights)."""
        lo, hi = b.shard_range(self.shard_rank)
        self._primary[b.index].copy_(self.bucket_view(b)[lo:hi])

    def invalidate_secondary(self) -> None:
        self.secondary_valid = [False] * len(self.buckets)

    def _set_empty(self, b: Bucket) -> None:
        for p in b.params:
            p.data = self._empty[b.dtype]

    # -- accounting -----------------------------------------------------------------------------------------------
    def live(self) -> int:
        return sum(p.live for p in self.pools.values())

    def peak_live(self) -> int:
        return sum(p.peak_live for p in self.pools.values())

    def reset_peak(self) -> None:
        for p in self.pools.values():
            p.reset_peak()

    def overflows(self) -> int:
        return sum(p.overflows for p in self.pools.values())


def _numel(shape: torch.Size) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
