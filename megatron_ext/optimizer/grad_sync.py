"""Gradient path: per-parameter hooks fill bucket buffers; full buckets are reduce-scattered asynchronously.

[Note: accumulation policies]
``shard``: every micro-batch reduce-scatters each bucket as soon as its last gradient arrives (pooled buffers,
ZeRO-2 memory) and accumulates into this rank's shard. ``local``: micro-batches inside ``no_sync()`` accumulate
full gradients in a persistent buffer; a synchronising micro-batch reduce-scatters it (ZeRO-1 traffic when only the
last micro-batch synchronises, like megatron-core). Without ``no_sync()`` every micro-batch synchronises, exactly
as under ``shard``: a persistent buffer is zeroed once its reduce-scatter has completed, and the next micro-batch
waits for that bucket's collective before it adds into the buffer again (never twice-counted, never raced).
``auto`` decides per step from the number of micro-batches: a step whose first backward runs inside
``no_sync()`` has M > 1 micro-batches, for which ``local`` sends M times less; a one-micro-batch step uses
``shard``, which sends the same bytes with bounded buffer memory.

[Note: sharding plans]
The accumulation policy is the plan's gradient factor (optimizer/sharding.py): ``local`` is ``grad = 1`` and
``shard`` is ``grad = optim``; ``auto`` decides per step as above. Whatever the policy, a bucket's reduction is a
reduce-scatter inside the optim group (``backend``), followed -- at the micro-batch that completes the step's
gradients, and only when the optim group is replicated -- by an all-reduce of the reduced shard across the
replicas (``replica_backend``), chained behind the reduce-scatter as one multi-phase work. Each bucket's shard
records whether it holds a partial sum (reduced inside the optim group only) or the full average, so micro-batches
reduced inside ``no_sync()`` are all-reduced across replicas once, with the last one, and micro-batches each
synchronised (no ``no_sync()``) are each all-reduced before they are added.

[Note: collective order]
All ranks must issue collectives in the same order, whatever order their gradients arrive in. Buckets are
therefore launched strictly in index order: a bucket that completes early waits for its predecessors. At the end
of each communicating backward (an autograd-engine callback) every remaining bucket is launched, including
buckets whose parameters got no gradient (they contribute zeros), so every rank issues exactly one
reduce-scatter per bucket. A bucket is complete when each of its *distinct* parameters has delivered a gradient.

[Note: the backward's end]
"The end of this backward" is the end of the outermost autograd graph task that reaches the wrapper's output. The
first gradient can arrive inside a nested one: megatron-core's full recomputation (a re-entrant checkpoint) runs
the recomputed layers' backward as a graph task of its own, and on a pipeline stage without the output layer those
layers produce the first gradients. A callback queued from that gradient would end the micro-batch when the nested
task ends and launch every bucket half full, then launch them again for the rest (right sums, up to twice the
bytes). So the wrapper hooks its forward output, and the backward reaching it (in the outer task) queues the end
there; a backward that never reaches it (the wrapper bypassed) ends at the first gradient's task, as before.

[Note: deferred buffers]
Deferred buckets (tied embeddings across pipeline stages, TP's q/k norms, sequence-parallel norms and biases:
gradients reduced over a model-parallel group first, in ``finish_grad_sync``) accumulate the whole step, so they
always need a persistent buffer. Each has its own, of the bucket's size; the full-size ``local`` buffer covers the
regular buckets only. (Carving the deferred buckets out of one full-size buffer kept a full copy of the gradients
in every step, so ZeRO-2 lost its gradient sharding on those ranks.)

[Note: multi-hop]
Hierarchical backends (qgZ, ByteGrad) reduce in several dependent hops; a hop can only be launched once the one
before has finished. Launching the next bucket is the moment the ODO drives them: every in-flight reduction is
advanced by one hop (``Work.advance()``), oldest first. Launch points are the same on every rank, so every group
sees the same collective sequence everywhere (advancing on ``is_completed()`` polls would not be), and the
inter-node hop of bucket k overlaps the backward of the buckets after it instead of waiting for the end.
With the progress engine (the default, comm/progress.py) the backends' works are engine works: ``advance()`` is a
no-op here, and the engine thread applies the same rule to the same launch sequence, off the training thread
(see [Note: progress engine]); a chained reduce-scatter + replica all-reduce is submitted as one engine work.

[Note: overlap off]
With ``overlap_grad_reduce=False`` pooled buckets are still reduced as they complete, but each reduce-scatter is
waited for at once (blocking, no overlap): the pool bound on live bucket buffers holds either way. Persistent
(``local``) buffers are reduced after the backward.

[Note: errors inside backward]
A gradient that arrives for a bucket already launched in this backward cannot be reduced any more. Raising inside
the hook would abort this rank's backward while its peers wait in the next reduce-scatter until the collective
timeout. Instead the error is recorded, the late gradient dropped and every collective still issued as on the
peers; the optimizer folds a "failed" flag into its first scalar all-reduce of the step, so every rank raises
together, before any weight changes.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..comm.backend import ChainedWork, CompletedWork, GradReduce, Work
from ..comm.engine_backend import submit_with
from ..comm.ledger import CommLedger
from .bucketing import Bucket
from .buffer_pool import BufferPool
from .group_collectives import MP_GRAD, all_reduce_, node_peers
from .param_buffer import ParameterBuffer
from .sharding import ResolvedPlan

logger = logging.getLogger(__name__)

MPReduction = Tuple[dist.ProcessGroup, bool]  # (group, average)

# What a bucket's slice of the reduced-gradient partition holds this step (see [Note: sharding plans]).
_FRESH, _PARTIAL, _REDUCED = range(3)


class _BucketState:
    __slots__ = ("buffer", "pooled", "arrived", "launched", "reading", "dirty")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None   # where this bucket's gradients accumulate
        self.pooled = False
        self.arrived: Set[int] = set()               # ids of the params that delivered a grad this micro-batch
        self.launched = False                        # reduce-scatter launched in this micro-batch
        self.reading: Optional[Callable[[], None]] = None  # in-flight reduce-scatter reading the persistent buffer
        self.dirty = False                           # persistent buffer holds gradients not yet reduced


class GradSync:
    def __init__(self, buckets: List[Bucket], param_buffer: ParameterBuffer, partition_grad: torch.Tensor,
                 backend: GradReduce, *, plan: ResolvedPlan, pool_size: int, grad_reduce_in_fp32: bool,
                 overlap: bool, mp_reductions: Dict[int, MPReduction], ledger: Optional[CommLedger] = None,
                 replica_backend: Optional[GradReduce] = None, post_reduce_scale: float = 1.0,
                 param_name: Optional[Callable[[torch.Tensor], str]] = None) -> None:
        """``backend`` reduce-scatters inside the optim group, ``replica_backend`` all-reduces across its replicas
        (None when the plan has one replica). ``post_reduce_scale`` multiplies each reduced (DP-averaged) shard
        once: the DP size under megatron's per-token loss, whose DDP contract is a sum over DP."""
        self.buckets = buckets
        self.regular = [b for b in buckets if not b.deferred]
        self.deferred = [b for b in buckets if b.deferred]
        self.param_buffer = param_buffer
        self.partition_grad = partition_grad
        self.backend = backend
        self.replica_backend = replica_backend
        self.plan = plan
        self.overlap = overlap
        self.mp_reductions = mp_reductions
        self.ledger = ledger
        self.post_reduce_scale = float(post_reduce_scale)
        self._param_name = param_name or (lambda p: f"<parameter of shape {tuple(p.shape)}>")
        self._mp_peers = {id(g): node_peers(g) for g, _ in mp_reductions.values()}
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
        self._deferred_own: Dict[int, torch.Tensor] = {}     # bucket index -> buffer ([Note: deferred buffers])
        self._state = [_BucketState() for _ in buckets]
        self._out_state = [_FRESH] * len(buckets)   # what each bucket's partition slice holds this step
        self._inflight: List[Callable[[], None]] = []
        self._inflight_works: List[Work] = []    # launch order, for Work.advance() (see [Note: multi-hop])
        self.sync_enabled = True
        self.step_mode: Optional[str] = None     # "pool" | "local", fixed at the step's first backward
        self.last_step_mode: Optional[str] = None
        self.error: Optional[str] = None         # recorded inside backward, raised by the optimizer on all ranks
        self._in_backward = False
        self._root_end_queued = False   # the outer graph task will end this micro-batch ([Note: the backward's end])
        self._comm_this_micro = False
        self._pending_local = False
        self._deferred_done = False
        self._next_launch = 0
        self._hooks = []
        # ZeRO-3: told when a bucket's gradients are all in (its weights can go) and when a backward ends.
        self.on_bucket_complete: Optional[Callable[[Bucket], None]] = None
        self.on_backward_end: Optional[Callable[[], None]] = None
        # The speculative step (speculative_step.py), set by the optimizer: told of the step's final launches, and
        # handed each regular bucket, in order, once its step's gradient is reduced (see _poll_speculation).
        self.speculation = None
        self._final_launch: Dict[int, Callable[[], None]] = {}   # bucket -> completion of its final reduction
        self.first_backward_order: Optional[List[int]] = None
        self._order_seen: Optional[List[int]] = []
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
            self._record_late_gradient(b, param)
            return
        buffer = self._writable_buffer(b, st)
        _, off = self.param_buffer.locate(param)
        with torch.no_grad():
            buffer[off:off + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        st.dirty = not st.pooled
        st.arrived.add(id(param))
        if len(st.arrived) < len(b.params):
            if self.speculation is not None and self.speculation.open:
                self._poll_speculation()   # hand over what finished since, without waiting for a bucket to fill
            return
        if self.on_bucket_complete is not None:
            self.on_bucket_complete(b)
        if self._order_seen is not None:
            self._order_seen.append(b.index)
        if self._comm_this_micro and not b.deferred and (self.overlap or st.pooled):
            self._launch_ready(complete_all=False, final=self.sync_enabled)
        elif self.speculation is not None:
            self._poll_speculation()

    def _record_late_gradient(self, b: Bucket, param: torch.Tensor) -> None:
        msg = (f"the gradient of {self._param_name(param)} arrived after its bucket's reduce-scatter was launched "
               "in this backward (a parameter whose gradient is accumulated again later in the same backward, e.g. "
               "by a nested or re-entrant backward); that gradient cannot be reduced")
        if self.error is None:
            self.error = msg
            logger.error("%s; the step will fail on every DP rank", msg)
        param.grad = None

    def _start_micro(self) -> None:
        self._in_backward = True
        if self.step_mode is None:
            # auto: M > 1 micro-batches iff the first backward of the step runs under no_sync()
            local = self.plan.accumulates_locally(multiple_micro_batches=not self.sync_enabled)
            self.step_mode = "local" if local else "pool"
            self.last_step_mode = self.step_mode
        self._comm_this_micro = self.step_mode == "pool" or self.sync_enabled
        if self._comm_this_micro and self.sync_enabled and self.replica_backend is not None:
            # This micro-batch all-reduces across replicas what earlier ones accumulated: their reduce-scatters
            # (launched during the previous backward, done long since in practice) must have been added first.
            self.wait_all()
        self._next_launch = 0
        self._reset_launch_flags()
        self._final_launch.clear()   # this micro-batch's final reductions only, never an earlier step's
        if not self._root_end_queued:
            Variable._execution_engine.queue_callback(self._end_micro)

    def backward_reached_output(self) -> None:
        """The backward reached the wrapper's forward output, in the graph task that will end the micro-batch."""
        if not self._root_end_queued:
            self._root_end_queued = True
            Variable._execution_engine.queue_callback(self._end_root)

    def _end_root(self) -> None:
        self._root_end_queued = False
        if self._in_backward:   # (no gradient arrived: nothing to end)
            self._end_micro()

    def _end_micro(self) -> None:
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()
        if self._order_seen is not None:
            self.first_backward_order = list(self._order_seen)
            if self.first_backward_order != sorted(self.first_backward_order):
                logger.info("gradient buckets completed out of index order %s: overlap is reduced, results are not "
                            "affected", self.first_backward_order)
            self._order_seen = None
        if self._comm_this_micro:
            self._launch_ready(complete_all=True, final=self.sync_enabled)
            self._pending_local = False
        else:
            self._pending_local = True
        for st in self._state:
            st.arrived.clear()

    # -- buffers ------------------------------------------------------------------------------------
    def _writable_buffer(self, b: Bucket, st: _BucketState) -> torch.Tensor:
        """The bucket's buffer, safe to add into: a persistent one whose previous reduce-scatter is still in
        flight is waited for first (that completion zeroes it)."""
        if st.reading is not None:
            st.reading()
        if st.buffer is None:
            st.buffer, st.pooled = self._get_buffer(b)
        return st.buffer

    def _get_buffer(self, b: Bucket) -> Tuple[torch.Tensor, bool]:
        gd = self.grad_dtype[b.dtype]
        if b.deferred:
            own = self._deferred_own.get(b.index)
            if own is None:
                own = self._deferred_own[b.index] = torch.zeros(b.numel, dtype=gd, device=self.partition_grad.device)
            return own, False
        if self.step_mode == "pool":
            return self.pools[gd].acquire(b.numel), True
        flat = self._local.get(b.dtype)
        if flat is None:
            total = max(x.buffer_offset + x.numel for x in self.regular if x.dtype == b.dtype)
            flat = self._local[b.dtype] = torch.zeros(total, dtype=gd, device=self.partition_grad.device)
        return flat[b.buffer_offset:b.buffer_offset + b.numel], False

    # -- launching ----------------------------------------------------------------------------------
    def _launch_ready(self, complete_all: bool, final: bool) -> None:
        while self._next_launch < len(self.regular):
            b = self.regular[self._next_launch]
            st = self._state[b.index]
            if not complete_all and len(st.arrived) < len(b.params):
                return
            self._launch(b, final)
            self._next_launch += 1
        if self.speculation is not None:
            self._poll_speculation()

    def _launch(self, b: Bucket, final: bool) -> None:
        """Reduce bucket ``b`` into its partition slice; ``final``: this micro-batch completes the step's gradients
        (the replica all-reduce runs with it, see [Note: sharding plans])."""
        st = self._state[b.index]
        buffer = self._writable_buffer(b, st)
        pooled = st.pooled
        out = self.partition_grad[b.partition_offset:b.partition_offset + b.shard_numel]
        state = self._out_state[b.index]
        accumulate = state != _FRESH
        target = torch.empty_like(out) if accumulate else out
        scale = self.post_reduce_scale
        replica = self.replica_backend if final else None
        # The replica all-reduce averages the partial sums in ``out``, or, when ``out`` already holds the full
        # average of earlier synchronised micro-batches, this micro-batch's own result before it is added.
        ar_tensor = target if state == _REDUCED else out
        self._out_state[b.index] = _REDUCED if (final or self.replica_backend is None) else _PARTIAL

        def after_reduce_scatter() -> None:
            if scale != 1.0:
                target.mul_(scale)
            if accumulate and not (replica is not None and ar_tensor is target):
                out.add_(target)

        # The all-reduce travels in the dtype the reduce-scatter used (bf16 without grad_reduce_in_fp32).
        wire = {}

        def start_all_reduce() -> Work:
            after_reduce_scatter()
            t = wire["t"] = ar_tensor if buffer.dtype == ar_tensor.dtype else ar_tensor.to(buffer.dtype)
            return replica.all_reduce(t)

        def after_all_reduce() -> Work:
            t = wire.pop("t")
            if t is not ar_tensor:
                ar_tensor.copy_(t)
            if accumulate and ar_tensor is target:
                out.add_(target)
            return CompletedWork()

        if replica is None:
            work: Work = self.backend.reduce_scatter(buffer, target)
            epilogue: Optional[Callable[[], None]] = after_reduce_scatter
        else:   # one engine work when a progress engine runs the backends: the chain advances on its thread
            rs = self.backend.reduce_scatter
            work = submit_with(self.backend, lambda: ChainedWork([lambda: rs(buffer, target), start_all_reduce,
                                                                  after_all_reduce]), (buffer, target, out))
            epilogue = None
        for earlier in self._inflight_works:  # oldest first, at the same program point on every rank
            earlier.advance()
        if work.multi_phase and not work.done:   # single-hop works (plain) have nothing to advance
            self._inflight_works.append(work)
        st.launched = True
        pool = self.pools[self.grad_dtype[b.dtype]] if pooled else None

        def complete() -> None:
            nonlocal work, target, buffer, epilogue
            if work is None:
                return
            self._complete_older(complete)
            work.wait()
            if epilogue is not None:
                epilogue()
            if pool is not None:
                pool.untrack(complete)
                pool.release(buffer)
            else:
                buffer.zero_()           # reduced: the next micro-batch starts from zero
                if st.reading is complete:
                    st.reading = None
            # Done: forget it at once, so a step of M micro-batches does not keep M scratch shards alive.
            if complete in self._inflight:
                self._inflight.remove(complete)
            if work in self._inflight_works:
                self._inflight_works.remove(work)
            work = target = buffer = epilogue = complete.work = None

        complete.work = work   # read by _poll_speculation, which must not block
        if final and not b.deferred and self.speculation is not None:
            self._final_launch[b.index] = complete
            self.speculation.note_final_launch()
        if pool is not None:
            pool.track(complete)
            st.buffer = None  # the pool owns it again once complete() runs
        else:
            st.reading = complete
            st.dirty = False
        self._inflight.append(complete)
        if pool is not None and not self.overlap:
            complete()  # overlap off: blocking, so the buffer returns to the pool at once

    def _poll_speculation(self) -> None:
        """Hand the speculative step each of its buckets whose final reduction has finished, in bucket order
        (see [Note: speculative step]). Never blocks and never issues a collective on the engine's groups: a bucket
        is handed over only when its reduction and every older one in flight are finished, so completing them
        here runs their epilogues only (an engine work's COMPLETE then finds nothing left to issue)."""
        spec = self.speculation
        if spec.open:
            spec.pump()
        while spec.open and spec.stepped < len(spec.buckets):
            b = spec.buckets[spec.stepped]
            complete = self._final_launch.get(b.index)
            if complete is None:
                return
            if complete in self._inflight:
                upto = self._inflight[:self._inflight.index(complete) + 1]
                if not all(_finished(getattr(c, "work", None), POLL_PATIENCE_S) for c in upto):
                    return
                complete()
            spec.on_reduced(b)

    def _reset_launch_flags(self) -> None:
        for st in self._state:
            st.launched = False

    # -- public -------------------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch every bucket not yet launched (for callers that do not overlap), and the replica all-reduce of
        shards that every micro-batch reduced inside ``no_sync()`` only (Megatron-LM's pipeline schedules run all
        backwards of a stage under no_sync and then call this)."""
        if self._pending_local or (self.step_mode == "pool" and self._next_launch < len(self.regular)):
            self._next_launch = 0 if self._pending_local else self._next_launch
            self._launch_ready(complete_all=True, final=True)
            self._pending_local = False
        self._reduce_partial_shards()

    def _reduce_partial_shards(self) -> None:
        """All-reduce across replicas every bucket shard still holding a partial sum, in bucket order on every
        rank (after the reduce-scatters that fill it: see [Note: sharding plans])."""
        partial = [b for b in self.regular if self._out_state[b.index] == _PARTIAL]
        if not partial or self.replica_backend is None:
            return
        self.wait_all()
        for b in partial:
            out = self.partition_grad[b.partition_offset:b.partition_offset + b.shard_numel]
            gd = self.grad_dtype[b.dtype]
            wire = out if gd == out.dtype else out.to(gd)
            work = self.replica_backend.all_reduce(wire)
            self._out_state[b.index] = _REDUCED
            if work.multi_phase and not work.done:
                self._inflight_works.append(work)
            self._inflight.append(self._completer(work, wire, out))

    def _complete_older(self, complete: Callable[[], None]) -> None:
        """Earlier launches first (see [Note: multi-hop]): finishing a multi-hop reduction issues its remaining hops,
        and this keeps every group's collective sequence in launch order on every rank, whichever bucket (buffer
        reuse, pool exhaustion) forced the wait."""
        for older in list(self._inflight):
            if older is complete:
                break
            older()

    def _completer(self, work: Work, wire: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """Completion of a replica all-reduce of a partial shard (earlier launches first, like ``_launch``)."""
        def complete() -> None:
            if complete not in self._inflight:
                return
            self._complete_older(complete)
            work.wait()
            if wire is not out:
                out.copy_(wire)
            self._inflight.remove(complete)
            if work in self._inflight_works:
                self._inflight_works.remove(work)
            complete.work = None
        complete.work = work
        return complete

    def finish_grad_sync(self) -> None:
        if self._in_backward:
            raise RuntimeError("finish_grad_sync() called during backward")
        if self._pending_local:
            # Local accumulation that never saw a synchronising micro-batch: reduce it now.
            self._next_launch = 0
            self._launch_ready(complete_all=True, final=True)
            self._pending_local = False
        self._reduce_partial_shards()
        if self.deferred and self.step_mode is not None and not self._deferred_done:
            self._reduce_deferred()
            self._deferred_done = True
        self.wait_all()
        self._reset_launch_flags()

    def _reduce_deferred(self) -> None:
        """Model-parallel all-reduce of tied / sequence-parallel grads, then their DP reduce-scatter."""
        for b in self.deferred:
            buffer = self._writable_buffer(b, self._state[b.index])
            for p, off, n in zip(b.params, b.offsets, b.sizes):
                group, average = self.mp_reductions[id(p)]
                g = buffer[off:off + n]
                all_reduce_(g, dist.ReduceOp.SUM, group, self.ledger, MP_GRAD, self._mp_peers[id(group)])
                if average:
                    g.div_(dist.get_world_size(group))
            self._launch(b, final=True)

    def wait_all(self) -> None:
        for complete in list(self._inflight):   # each removes itself once done
            complete()
        self._inflight_works.clear()

    def zero_grad(self) -> None:
        self.wait_all()
        # a backward that raised never ran its end callbacks: the next step's first backward starts afresh
        self._in_backward = self._root_end_queued = False
        self.partition_grad.zero_()
        self._out_state = [_FRESH] * len(self.buckets)
        for st in self._state:
            if st.buffer is not None and st.pooled:
                self.pools[st.buffer.dtype].release(st.buffer)
            elif st.buffer is not None and st.dirty:
                st.buffer.zero_()    # accumulated but never reduced (e.g. a step that was abandoned)
            st.buffer = None
            st.arrived.clear()
            st.launched = False
            st.dirty = False
        self.step_mode = None
        self.error = None
        self._final_launch.clear()
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


# Test hook: how long _poll_speculation waits for a reduction to finish before leaving it for later (0: never).
POLL_PATIENCE_S = 0.0


def _finished(work: Optional[Work], patience_s: float = 0.0) -> bool:
    """Whether ``work`` is finished with nothing left to issue, known without blocking: an engine work the engine
    has completed, or a finished single-phase handle (timing-dependent: only for the speculative step's polling,
    whose collectives go to a group of their own). ``patience_s``: look again until then (tests)."""
    if work is None:
        return False
    if getattr(work, "_error", None) is not None:
        return False   # a failed engine work: raised where the step waits for it, not inside the backward
    deadline = time.monotonic() + patience_s
    while True:
        finished = getattr(work, "finished", None)
        if finished if finished is not None else (not work.multi_phase and work.ready):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
