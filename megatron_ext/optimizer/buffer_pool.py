"""Buffer alternation: a small pool of reusable bucket-sized gradient buffers.

Bucket buffers live from the first gradient of a bucket until its reduce-scatter completes. Reusing a fixed
set avoids allocator churn and bounds memory: when every buffer is busy, the oldest in-flight reduce-scatter is
waited for and its buffer handed over. Only an out-of-order backward (a bucket's gradients arriving while all
pooled buffers still accumulate unfinished buckets) forces an extra buffer; that is counted in ``overflows``.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, List

import torch


class BufferPool:
    def __init__(self, size: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if size < 1:
            raise ValueError(f"buffer pool size must be >= 1, got {size}")
        self.size = size
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self._free: List[torch.Tensor] = []
        self._allocated = 0
        self._live = 0
        self.peak_live = 0
        self.overflows = 0
        # In-flight users in launch order: callables that complete the user's work and release its buffer.
        self._inflight: Deque[Callable[[], None]] = deque()

    def acquire(self, numel: int, zero: bool = True) -> torch.Tensor:
        """A buffer of ``numel`` elements (a view of a pooled buffer), zeroed unless ``zero=False``."""
        if numel > self.numel:
            raise ValueError(f"bucket of {numel} elements exceeds the pool's buffer size {self.numel}")
        while not self._free and self._allocated >= self.size and self._inflight:
            self._inflight.popleft()()  # completes the oldest reduce-scatter, which releases its buffer
        if self._free:
            buf = self._free.pop()
        else:
            if self._allocated >= self.size:
                self.overflows += 1
            buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self._allocated += 1
        self._live += 1
        self.peak_live = max(self.peak_live, self._live)
        view = buf[:numel]
        if zero:
            view.zero_()
        view._mx_pool_base = buf  # type: ignore[attr-defined]
        return view

    def release(self, view: torch.Tensor) -> None:
        base = getattr(view, "_mx_pool_base", None)
        if base is None:
            raise ValueError("tensor was not acquired from this pool")
        self._live -= 1
        if self._allocated > self.size:  # drop overflow buffers instead of keeping them
            self._allocated -= 1
        else:
            self._free.append(base)

    def track(self, completer: Callable[[], None]) -> None:
        """Register an in-flight operation whose completion releases a buffer."""
        self._inflight.append(completer)

    def untrack(self, completer: Callable[[], None]) -> None:
        try:
            self._inflight.remove(completer)
        except ValueError:
            pass

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pooled buffers currently allocated (overflow buffers included while they live)."""
        return self._allocated * self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def live(self) -> int:
        return self._live

    def reset_peak(self) -> None:
        self.peak_live = self._live
