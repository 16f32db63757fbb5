"""Bucket assignment: whole parameters, reverse registration order, padded to P equal aligned shards.

[Note: layout]
Parameters of one dtype are walked in reverse registration order (the approximate order their gradients appear
in backward) and packed greedily into buckets of at most ``bucket_size`` elements; a parameter at least that large
gets a bucket of its own. Inside a bucket parameters are contiguous. The bucket is then padded with zeros to
``P * shard_numel`` elements, ``shard_numel`` being the data size divided by P rounded up to ``alignment``, P the
number of shards (the sharding plan's optim factor: the DP size by default). The rank with shard index r (its rank
in the optim group) owns ``[r * shard_numel, (r + 1) * shard_numel)`` of every bucket. No divisibility is asked.

Buckets of params whose gradients need a model-parallel all-reduce before the DP reduction (pipeline-tied
embeddings, sequence-parallel norms) are ``deferred``: they are reduced once, in ``finish_grad_sync``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

import torch


@dataclasses.dataclass
class Bucket:
    index: int
    dtype: torch.dtype
    params: List[torch.nn.Parameter]
    offsets: List[int]            # start of each param inside the bucket (elements)
    sizes: List[int]              # elements of each param (ZeRO-3 empties p.data while a bucket is released)
    data_numel: int               # elements holding parameters
    shard_numel: int              # elements per rank
    num_shards: int
    buffer_offset: int = 0        # start of the bucket in its dtype's ParameterBuffer
    partition_offset: int = 0     # start of this bucket's shard in the rank's flat fp32 partition
    deferred: bool = False

    @property
    def numel(self) -> int:
        """Padded size: ``num_shards * shard_numel``."""
        return self.shard_numel * self.num_shards

    @property
    def padding(self) -> int:
        return self.numel - self.data_numel

    def shard_range(self, rank: int) -> Tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned_pieces(self, rank: int) -> List[Tuple[int, int, int, int]]:
        """``(param_idx, param_start, param_end, shard_start)`` for each param slice inside ``rank``'s shard."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for i, (n, off) in enumerate(zip(self.sizes, self.offsets)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                pieces.append((i, a - off, b - off, a - lo))
        return pieces


def shard_numel_for(data_numel: int, num_shards: int, alignment: int) -> int:
    per_rank = max(1, math.ceil(data_numel / num_shards))
    return math.ceil(per_rank / alignment) * alignment


def assign_buckets(params: Sequence[torch.nn.Parameter], bucket_size: int, num_shards: int, alignment: int,
                   deferred: Sequence[bool] | None = None) -> List[Bucket]:
    """Group ``params`` (registration order) into buckets; see the module note for the rules."""
    if bucket_size <= 0:
        raise ValueError(f"bucket_size (--ddp-bucket-size) must be > 0, got {bucket_size}")
    if num_shards <= 0 or alignment <= 0:
        raise ValueError(f"num_shards (the optim shard size) and alignment must be positive, got {num_shards}, {alignment}")
    deferred = list(deferred) if deferred is not None else [False] * len(params)
    # Key: (dtype, deferred); reverse registration order within each key.
    groups: Dict[Tuple[torch.dtype, bool], List[torch.nn.Parameter]] = {}
    for p, d in zip(reversed(list(params)), reversed(deferred)):
        groups.setdefault((p.dtype, d), []).append(p)
    buckets: List[Bucket] = []
    # Regular buckets first, deferred ones last: they are reduced after everything else.
    for (dtype, is_deferred), plist in sorted(groups.items(), key=lambda kv: (kv[0][1], str(kv[0][0]))):
        current: List[torch.nn.Parameter] = []
        size = 0
        for p in plist:
            if current and size + p.numel() > bucket_size:
                buckets.append(_make(current, dtype, num_shards, alignment, is_deferred))
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(_make(current, dtype, num_shards, alignment, is_deferred))
    partition = 0
    per_dtype: Dict[torch.dtype, int] = {}
    for i, b in enumerate(buckets):
        b.index = i
        b.buffer_offset = per_dtype.get(b.dtype, 0)
        per_dtype[b.dtype] = b.buffer_offset + b.numel
        b.partition_offset = partition
        partition += b.shard_numel
    return buckets


def _make(params: List[torch.nn.Parameter], dtype: torch.dtype, num_shards: int, alignment: int,
          deferred: bool) -> Bucket:
    offsets, off = [], 0
    for p in params:
        offsets.append(off)
        off += p.numel()
    return Bucket(index=-1, dtype=dtype, params=list(params), offsets=offsets, sizes=[p.numel() for p in params],
                  data_numel=off,
                  shard_numel=shard_numel_for(off, num_shards, alignment), num_shards=num_shards, deferred=deferred)
