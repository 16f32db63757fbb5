"""ParameterBuffer: one flat tensor per parameter dtype; every parameter's ``.data`` is a view into it.

The all-gather after the optimizer step writes straight into the buffer, so weights are never copied twice.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .bucketing import Bucket


class ParameterBuffer:
    def __init__(self, buckets: List[Bucket], device: torch.device) -> None:
        self.buckets = buckets
        sizes: Dict[torch.dtype, int] = {}
        for b in buckets:
            sizes[b.dtype] = max(sizes.get(b.dtype, 0), b.buffer_offset + b.numel)
        # Zero-filled: padding stays zero forever (it is never written by an optimizer).
        self.flat: Dict[torch.dtype, torch.Tensor] = {
            dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
        self._where: Dict[int, Tuple[Bucket, int]] = {}
        with torch.no_grad():
            for b in buckets:
                view = self.bucket_view(b)
                for p, off in zip(b.params, b.offsets):
                    dst = view[off:off + p.numel()].view(p.shape)
                    dst.copy_(p.detach())  # handles non-contiguous params (e.g. a transpose)
                    p.data = dst
                    self._where[id(p)] = (b, off)

    def bucket_view(self, b: Bucket) -> torch.Tensor:
        return self.flat[b.dtype][b.buffer_offset:b.buffer_offset + b.numel]

    def shard_view(self, b: Bucket, rank: int) -> torch.Tensor:
        lo, hi = b.shard_range(rank)
        return self.bucket_view(b)[lo:hi]

    def locate(self, p: torch.nn.Parameter) -> Tuple[Bucket, int]:
        return self._where[id(p)]

    def numel(self) -> int:
        return sum(t.numel() for t in self.flat.values())
