"""Gradient path: per-parameter hooks fill bucket buffers; full buckets are reduce-scattered asynchronously.

[Note: accumulation policies]
``shard``: every micro-batch reduce-scatters each bucket as soon as its last gradient arrives (pooled buffers,
ZeRO-2 memory) and accumulates into this rank's shard. ``local``: micro-batches inside ``no_sync()`` accumulate
full gradients in a persistent buffer; the last one reduce-scatters once (ZeRO-1 traffic, like megatron-core).
``auto`` decides per step from the number of micro-batches: a step whose first backward runs inside
``no_sync()`` has M > 1 micro-batches, for which ``local`` sends M times less; a one-micro-batch step uses
``shard``, which sends the same bytes with bounded buffer memory.

[Note: collective order]
All ranks must issue collectives in the same order, whatever order their gradients arrive in. Buckets are
therefore launched strictly in index order: a bucket that completes early waits for its predecessors. At the end
of each communicating backward (an autograd-engine callback) every remaining bucket is launched, including
buckets whose parameters got no gradient (they contribute zeros), so every rank issues exactly one
reduce-scatter per bucket.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..comm.backend import GradReduce, Work
from .bucketing import Bucket
from .buffer_pool import BufferPool
from .param_buffer import ParameterBuffer

logger = logging.getLogger(__name__)

MPReduction = Tuple[dist.ProcessGroup, bool]  # (group, average)


class _BucketState:
    __slots__ = ("buffer", "pooled", "arrived", "launched", "completer")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self.pooled = False
        self.arrived = 0
        self.launched = False
        self.completer: Optional[Callable[[], None]] = None


class GradSync:
    def __init__(self, buckets: List[Bucket], param_buffer: ParameterBuffer, partition_grad: torch.Tensor,
                 backend: GradReduce, *, rank: int, policy: str, pool_size: int, grad_reduce_in_fp32: bool,
                 overlap: bool, mp_reductions: Dict[int, MPReduction]) -> None:
        self.buckets = buckets
        self.regular = [b for b in buckets if not b.deferred]
        self.deferred = [b for b in buckets if b.deferred]
        self.param_buffer = param_buffer
        self.partition_grad = partition_grad
        self.backend = backend
        self.rank = rank
        self.policy = policy
        self.overlap = overlap
        self.mp_reductions = mp_reductions
        device = partition_grad.device
        self.grad_dtype: Dict[torch.dtype, torch.dtype] = {
            b.dtype: (torch.float32 if grad_reduce_in_fp32 else b.dtype) for b in buckets}
        self.pools: Dict[torch.dtype, BufferPool] = {}
        for b in self.regular:
            gd = self.grad_dtype[b.dtype]
            biggest = max(x.numel for x in self.regular if self.grad_dtype[x.dtype] == gd)
            if gd not in self.pools:
                self.pools[gd] = BufferPool(pool_size, biggest, gd, device)
        self._local: Dict[torch.dtype, torch.Tensor] = {}   # persistent full-gradient buffers, lazily made
        self._state = [_BucketState() for _ in buckets]
        self._fresh = [True] * len(buckets)      # shard slice not yet written this step
        self._inflight: List[Callable[[], None]] = []
        self.sync_enabled = True
        self.step_mode: Optional[str] = None     # "pool" | "local", fixed at the step's first backward
        self.last_step_mode: Optional[str] = None
        self._in_backward = False
        self._comm_this_micro = False
        self._pending_local = False
        self._deferred_done = False
        self._next_launch = 0
        self._hooks = []
        self.first_backward_order: Optional[List[int]] = None
        self._order_seen: List[int] = []
        for b in buckets:
            for p in b.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(b)))

    # -- hooks --------------------------------------------------------------------------------------
    def _make_hook(self, bucket: Bucket):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(bucket, param)
        return hook

    def _on_grad(self, b: Bucket, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self._in_backward:
            self._start_micro()
        st = self._state[b.index]
        if st.launched:
            raise RuntimeError(
                "a gradient arrived for a bucket whose reduce-scatter was already launched in this backward "
                "(a parameter used after its bucket completed, or a second backward without zero_grad)")
        if st.buffer is None:
            st.buffer, st.pooled = self._get_buffer(b)
        _, off = self.param_buffer.locate(param)
        with torch.no_grad():
            st.buffer[off:off + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        st.arrived += 1
        if st.arrived == len(b.params) and self._order_seen is not None:
            self._order_seen.append(b.index)
        if self.overlap and self._comm_this_micro and not b.deferred:
            self._launch_ready(complete_all=False)

    def _start_micro(self) -> None:
        self._in_backward = True
        if self.step_mode is None:
            if self.policy == "shard":
                self.step_mode = "pool"
            elif self.policy == "local":
                self.step_mode = "local"
            else:  # auto: M > 1 micro-batches iff the first backward of the step runs under no_sync()
                self.step_mode = "pool" if self.sync_enabled else "local"
            self.last_step_mode = self.step_mode
        self._comm_this_micro = self.step_mode == "pool" or self.sync_enabled
        self._next_launch = 0
        for st in self._state:
            st.launched = False
        Variable._execution_engine.queue_callback(self._end_micro)

    def _end_micro(self) -> None:
        self._in_backward = False
        if self._order_seen is not None:
            self.first_backward_order = list(self._order_seen)
            expected = [b.index for b in self.buckets if self._state[b.index].arrived == len(b.params)]
            if self.first_backward_order != sorted(self.first_backward_order):
                logger.info("gradient buckets completed out of index order %s (expected %s): overlap is reduced, "
                            "results are not affected", self.first_backward_order, expected)
            self._order_seen = None
        if self._comm_this_micro:
            self._launch_ready(complete_all=True)
            self._pending_local = False
        else:
            self._pending_local = True
        for st in self._state:
            st.arrived = 0

    # -- buffers ------------------------------------------------------------------------------------
    def _get_buffer(self, b: Bucket) -> Tuple[torch.Tensor, bool]:
        gd = self.grad_dtype[b.dtype]
        if self.step_mode == "pool" and not b.deferred:
            return self.pools[gd].acquire(b.numel), True
        flat = self._local.get(b.dtype)
        if flat is None:
            total = max(x.buffer_offset + x.numel for x in self.buckets if x.dtype == b.dtype)
            flat = self._local[b.dtype] = torch.zeros(total, dtype=gd, device=self.partition_grad.device)
        return flat[b.buffer_offset:b.buffer_offset + b.numel], False

    # -- launching ----------------------------------------------------------------------------------
    def _launch_ready(self, complete_all: bool) -> None:
        while self._next_launch < len(self.regular):
            b = self.regular[self._next_launch]
            st = self._state[b.index]
            if not complete_all and st.arrived < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: Bucket) -> None:
        st = self._state[b.index]
        if st.buffer is None:
            st.buffer, st.pooled = self._get_buffer(b)
        out = self.partition_grad[b.partition_offset:b.partition_offset + b.shard_numel]
        if self._fresh[b.index]:
            target, accumulate = out, False
            self._fresh[b.index] = False
        else:
            target, accumulate = torch.empty_like(out), True
        work: Work = self.backend.reduce_scatter(st.buffer, target)
        st.launched = True
        buffer, pooled = st.buffer, st.pooled
        pool = self.pools[self.grad_dtype[b.dtype]] if pooled else None
        done = [False]

        def complete() -> None:
            if done[0]:
                return
            done[0] = True
            work.wait()
            if accumulate:
                out.add_(target)
            if pool is not None:
                pool.untrack(complete)
                pool.release(buffer)
            if st.buffer is buffer and pooled:
                st.buffer = None

        st.completer = complete
        if pool is not None:
            pool.track(complete)
            st.buffer = None  # the pool owns it again once complete() runs
        self._inflight.append(complete)

    def _reset_launch_flags(self) -> None:
        for st in self._state:
            st.launched = False

    # -- public -------------------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch every bucket not yet launched (for callers that do not overlap)."""
        if self._pending_local or (self.step_mode == "pool" and self._next_launch < len(self.regular)):
            self._next_launch = 0 if self._pending_local else self._next_launch
            self._launch_ready(complete_all=True)
            self._pending_local = False

    def finish_grad_sync(self) -> None:
        if self._in_backward:
            raise RuntimeError("finish_grad_sync() called during backward")
        if self._pending_local:
            # Local accumulation that never saw a synchronising micro-batch: reduce it now.
            self._next_launch = 0
            self._launch_ready(complete_all=True)
            self._pending_local = False
        if self.deferred and self.step_mode is not None and not self._deferred_done:
            self._reduce_deferred()
            self._deferred_done = True
        self.wait_all()
        self._reset_launch_flags()

    def _reduce_deferred(self) -> None:
        """Model-parallel all-reduce of tied / sequence-parallel grads, then their DP reduce-scatter."""
        for b in self.deferred:
            st = self._state[b.index]
            if st.buffer is None:
                st.buffer, st.pooled = self._get_buffer(b)
            for p, off in zip(b.params, b.offsets):
                group, average = self.mp_reductions[id(p)]
                g = st.buffer[off:off + p.numel()]
                dist.all_reduce(g, group=group)
                if average:
                    g.div_(dist.get_world_size(group))
            self._launch(b)

    def wait_all(self) -> None:
        inflight, self._inflight = self._inflight, []
        for complete in inflight:
            complete()

    def zero_grad(self) -> None:
        self.wait_all()
        self.partition_grad.zero_()
        self._fresh = [True] * len(self.buckets)
        for flat in self._local.values():
            flat.zero_()
        for st in self._state:
            if st.buffer is not None and st.pooled:
                self.pools[st.buffer.dtype].release(st.buffer)
            st.buffer = None
            st.arrived = 0
            st.launched = False
        self.step_mode = None
        self._pending_local = False
        self._deferred_done = False
        self._next_launch = 0

    def live_buffers(self) -> int:
        return sum(p.live for p in self.pools.values())

    def peak_live_buffers(self) -> int:
        return sum(p.peak_live for p in self.pools.values())

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
