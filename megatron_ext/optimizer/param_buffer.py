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
        # Uninitialised, then filled parameter by parameter while each original storage is released: the model
        # is never resident twice (a zero-filled buffer would be). Padding is zeroed explicitly and stays zero
        # forever (it is never written by an optimizer).
        self.flat: Dict[torch.dtype, torch.Tensor] = {
            dt: torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()}
        self._where: Dict[int, Tuple[Bucket, int]] = {}
        with torch.no_grad():
            ends = {dt: 0 for dt in sizes}
            for b in sorted(buckets, key=lambda b: (str(b.dtype), b.buffer_offset)):
                view = self.bucket_view(b)
                flat = self.flat[b.dtype]
                for p, off in sorted(zip(b.params, b.offsets), key=lambda po: po[1]):
                    flat[ends[b.dtype]:b.buffer_offset + off].zero_()      # gap before this parameter
                    dst = view[off:off + p.numel()].view(p.shape)
                    dst.copy_(p.detach())  # handles non-contiguous params (e.g. a transpose)
                    p.data = dst
                    self._where[id(p)] = (b, off)
                    ends[b.dtype] = b.buffer_offset + off + p.numel()
            for dt, t in self.flat.items():
                t[ends[dt]:].zero_()                                       # padding after the last parameter

    def bucket_view(self, b: Bucket) -> torch.Tensor:
        return self.flat[b.dtype][b.buffer_offset:b.buffer_offset + b.numel]

    def shard_view(self, b: Bucket, rank: int) -> torch.Tensor:
        lo, hi = b.shard_range(rank)
        return self.bucket_view(b)[lo:hi]

    def locate(self, p: torch.nn.Parameter) -> Tuple[Bucket, int]:
        return self._where[id(p)]

    def numel(self) -> int:
        return sum(t.numel() for t in self.flat.values())
