"""ZeRO-3 parameter storage: primary shards, hpZ secondary shards, and full buckets only while they are needed.

[Note: storage]
With a sharding plan's ``param > 1`` a rank keeps, per parameter dtype, one flat *primary* tensor holding its shard
of every bucket (the same shard the optimizer updates; in model dtype). A bucket's full weights exist only while
it is *gathered*: every bucket has its own full-size tensor, every parameter's ``.data`` a fixed view into it, whose
storage is resized to zero bytes when the bucket is released and back to full size (then all-gathered from the
primary shards of the param group, or from the hpZ secondary pieces inside the node) when it is needed again. Views
that autograd saved in forward (``weight.t()`` of a linear layer) keep pointing at that storage, so backward reads
the re-gathered values (FSDP's resize-storage technique; a pool of shared buffers would hand backward another
bucket's weights). Reading a released bucket's storage directly is undefined (an error or a crash, never stale
values); attribute reads gather it (param_schedule.py, [Note: reads outside the schedule]). The
number of gathered buckets is bounded by ``gather_pool_size`` (prefetching stops there). With hpZ
(``hpz > 1``) the release after forward first copies this rank's slice of the full bucket -- the bucket cut into
``hpz`` equal pieces, piece ``dp_rank % hpz`` -- into a flat *secondary* tensor, valid until the weights change
(optimizer step, state-dict load), when :meth:`invalidate_secondary` drops it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .bucketing import Bucket
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
        self.pool_size = pool_size
        self._full: List[torch.Tensor] = []
        self._gathered = [False] * len(buckets)
        self._live = self._peak = self._overflows = 0
        for b in buckets:
            t = torch.empty(b.numel, dtype=b.dtype, device=device)
            for p, off, n in zip(b.params, b.offsets, b.sizes):
                p.data = t[off:off + n].view(self._shapes[id(p)])
            t.untyped_storage().resize_(0)
            self._full.append(t)

    # -- views --------------------------------------------------------------------------------------------------
    def shard_view(self, b: Bucket, rank: int) -> torch.Tensor:
        """This rank's primary shard of ``b`` (other ranks' shards are not held)."""
        if rank != self.shard_rank:
            raise ValueError(f"rank {self.shard_rank} holds only its own shard of bucket {b.index}, not {rank}'s")
        return self._primary[b.index]

    def secondary_view(self, b: Bucket) -> torch.Tensor:
        return self._secondary[b.index]

    def bucket_view(self, b: Bucket) -> torch.Tensor:
        if not self._gathered[b.index]:
            raise RuntimeError(f"bucket {b.index} is not gathered")
        return self._full[b.index]

    def locate(self, p: torch.nn.Parameter) -> Tuple[Bucket, int]:
        return self._where[id(p)]

    def numel(self) -> int:
        return sum(t.numel() for t in self.flat.values())

    # -- gathered buckets -----------------------------------------------------------------------------------------
    def is_gathered(self, idx: int) -> bool:
        return self._gathered[idx]

    def has_room(self) -> bool:
        """Whether another bucket may be gathered ahead of need (prefetch) within ``gather_pool_size``."""
        return self._live < self.pool_size

    def acquire(self, b: Bucket) -> torch.Tensor:
        """``b``'s full tensor with its storage back (contents undefined until a gather fills it)."""
        t = self._full[b.index]
        if t.untyped_storage().nbytes() == 0:
            t.untyped_storage().resize_(b.numel * t.element_size())
            self._live += 1
            self._overflows += self._live > self.pool_size
            self._peak = max(self._peak, self._live)
        return t

    def materialize(self, b: Bucket, full: torch.Tensor) -> None:
        """The gather into ``full`` (``b``'s own tensor) completed: its parameters are readable."""
        self._gathered[b.index] = True

    def keep_secondary(self, b: Bucket) -> None:
        """Copy this rank's hpZ piece of the gathered bucket (before it is released after forward)."""
        if self.hpz > 1 and not self.secondary_valid[b.index]:
            m = b.numel // self.hpz
            self._secondary[b.index].copy_(self.bucket_view(b)[self.hpz_rank * m:(self.hpz_rank + 1) * m])
            self.secondary_valid[b.index] = True

    def release(self, b: Bucket) -> None:
        t = self._full[b.index]
        self._gathered[b.index] = False
        if t.untyped_storage().nbytes():
            t.untyped_storage().resize_(0)
            self._live -= 1

    def write_back(self, b: Bucket) -> None:
        """The gathered bucket's values become this rank's primary shard (after a load into the full weights)."""
        lo, hi = b.shard_range(self.shard_rank)
        self._primary[b.index].copy_(self.bucket_view(b)[lo:hi])

    def invalidate_secondary(self) -> None:
        self.secondary_valid = [False] * len(self.buckets)

    # -- accounting -----------------------------------------------------------------------------------------------
    def live(self) -> int:
        return self._live

    def peak_live(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._live

    def overflows(self) -> int:
        """Gathers that went past ``gather_pool_size`` (a call needing more buckets at once than the pool)."""
        return self._overflows

    def gathered_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._full)


def _numel(shape: torch.Size) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
