"""ZeRO-3 parameter path: gather a bucket just before a module needs it, prefetch the next, release after last use.

[Note: reads outside the schedule]
A weight read through its module attribute (``module.weight``) while its bucket is released gathers the bucket on
the spot: that is a collective, so such reads (user code between steps, logging) must happen on every DP rank, or be
preceded by ``force_param_sync()`` on every rank. A read that bypasses attributes (a stored reference, iterating
``parameters()``) of a released bucket touches empty storage: undefined, it may crash the process. Gather first.

[Note: the schedule]
The first forward runs with every bucket gathered and records, per call of a module that reads bucketed weights
(its own, through the read guard, or through any op outside ``torch.compile``'d regions: the audit of
``param_sync``, whose rule for compiled code applies here too: weights come into it as arguments or by attribute),
which buckets the call used, in call order, and where each call ends. From that record:

- forward: a call's pre-hook waits for (or gathers) the buckets it uses, then prefetches the buckets of the next
  calls in recorded order while the pool has a free buffer; a bucket is released at the end of the call that last
  used it (a tied embedding read again by the output layer stays until then). With hpZ its secondary piece is kept
  first. A call that does not match the record (another control flow) turns the schedule off for the rest of that
  forward: buckets are then gathered on demand and released at its end, still correct;
- backward: a hook on each output of a recorded call (registered at the end of the call, like FSDP's pre-backward
  hooks) gathers the call's buckets -- from the hpZ secondary pieces inside the node when they are valid -- and
  prefetches the buckets of the calls before it; a bucket is released once all of its gradients have been
  delivered (no op can read it after its last AccumulateGrad), and every bucket at the end of the backward;
- activation recomputation re-runs forwards inside the backward: their pre-hooks gather what the record says and
  release nothing (the gradients release it).

Gathers are collectives: every rank issues them at the same program points (same record, same control flow), in
the order the hooks run, so every group sees the same sequence everywhere. A weight read outside any recorded call
(user code between steps, the read guard) gathers its bucket on demand; it stays until the next release point.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

from ..comm.backend import ParamGather, Work
from ..comm.progress import drain_at_exit
from .bucketing import Bucket
from .param_sync import ParamUseAudit, guard_parameter_reads, owner_buckets
from .sharded_params import ShardedParameterStore


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ShardedParamSync:
    def __init__(self, module: torch.nn.Module, buckets: List[Bucket], store: ShardedParameterStore,
                 backend: ParamGather, secondary_gather: Optional[Callable[[torch.Tensor, torch.Tensor], Work]],
                 overlap: bool) -> None:
        self.module = module
        self.buckets = buckets
        self.store = store
        self.backend = backend
        self.secondary_gather = secondary_gather
        self.overlap = overlap
        self.bucket_of_param: Dict[int, int] = {id(p): b.index for b in buckets for p in b.params}
        self._owners = owner_buckets(module, self.bucket_of_param)
        self._modules = {id(m): m for m in module.modules()}
        self._works: Dict[int, Tuple[Work, torch.Tensor]] = {}
        drain_at_exit(self)   # gathers in flight at interpreter exit (see comm/progress.py, *Exit*)
        # The record (see the module note).
        self.learning = True
        self.calls: List[Tuple[int, frozenset]] = []     # (module id, buckets used) per recorded call
        self._release_after: Dict[int, List[int]] = {}   # call index -> buckets whose last use it is
        self._stack: List[int] = []                      # running calls (indices into self.calls / _uses)
        self._uses: List[Set[int]] = []
        self._ends: List[int] = []                        # call indices in the order they ended
        self._recorder: Optional[ParamUseAudit] = None
        self._learn_handles: List = []
        self._handles: List = []
        # Per forward.
        self._next = 0
        self._on_schedule = True
        self._call_of_module: Dict[int, List[int]] = {}
        self._running: Dict[int, Optional[int]] = {}     # module id -> the recorded call it is running (or None)
        guard_parameter_reads(module, self.bucket_of_param, self)
        self._handles.append(module.register_forward_pre_hook(self._root_pre, prepend=True))
        self._handles.append(module.register_forward_hook(self._root_post, always_call=True))
        # Loading into (or reading) the module directly, not through the wrapper, must see gathered weights: a
        # copy into a released bucket's empty storage would write out of bounds.
        module.register_load_state_dict_pre_hook(lambda *a, **k: self.gather_all())
        module.register_load_state_dict_post_hook(lambda *a, **k: self._after_load())
        module.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self._check_readable(keep_vars))

    # -- learning -------------------------------------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        if _in_backward():
            return
        self.store.reset_peak()
        self._next, self._on_schedule = 0, True
        if self.learning and self._recorder is None:
            self.gather_all()
            for m in self.module.modules():
                if m is not self.module:   # the root's call is opened here and closed in _root_post
                    self._learn_handles.append(m.register_forward_pre_hook(self._learn_pre))
                    self._learn_handles.append(m.register_forward_hook(self._learn_post, always_call=True))
            self._learn_pre(self.module, args)
            self._recorder = ParamUseAudit(self.bucket_of_param, self.note_use)
            self._recorder.__enter__()

    def _learn_pre(self, module, args) -> None:
        self._stack.append(len(self._uses))
        self._uses.append(set(self._owners.get(id(module), ())))
        self.calls.append((id(module), frozenset()))

    def _learn_post(self, module, args, output) -> None:
        k = self._stack.pop()
        self._ends.append(k)
        # Another forward may release these buckets before this one's backward (pipeline schedules run several
        # forwards first): the recording forward's outputs get backward gathers like any other.
        self._register_backward(frozenset(self._uses[k]), output)

    def note_use(self, idx: int) -> None:
        if self._recorder is not None and self._stack:
            self._uses[self._stack[-1]].add(idx)

    def _finish_learning(self) -> None:
        for h in self._learn_handles:
            h.remove()
        self._learn_handles = []
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        # Keep the calls that use buckets; a bucket's release point is the last of those calls to end.
        keep = [k for k in range(len(self.calls)) if self._uses[k]]
        new_index = {k: i for i, k in enumerate(keep)}
        self.calls = [(self.calls[k][0], frozenset(self._uses[k])) for k in keep]
        last_end: Dict[int, int] = {}
        for k in self._ends:
            if k in new_index:
                for idx in self._uses[k]:
                    last_end[idx] = new_index[k]
        self._release_after = {}
        for idx, i in last_end.items():
            self._release_after.setdefault(i, []).append(idx)
        self._call_of_module = {}
        for i, (mid, _) in enumerate(self.calls):
            self._call_of_module.setdefault(mid, []).append(i)
        for mid in self._call_of_module:
            m = self._modules[mid]
            self._handles.append(m.register_forward_pre_hook(self._make_pre(mid)))
            self._handles.append(m.register_forward_hook(self._make_post(mid), always_call=True))
        self._uses, self._ends, self._stack = [], [], []
        self.learning = False

    def _root_post(self, module, args, output) -> None:
        if _in_backward():
            return
        if self._recorder is not None:
            # First forward: every bucket stays gathered (until a later forward or this backward releases it).
            self._learn_post(module, args, output)
            self._finish_learning()
            return
        if not self._on_schedule or self._next != len(self.calls):
            # Off the record: whatever is still gathered is released here (forward is over).
            self._release_many([i for i in range(len(self.buckets)) if self.store.is_gathered(i)])
        self._on_schedule = True

    # -- forward and recompute ------------------------------------------------------------------------------------
    def _make_pre(self, mid: int):
        def hook(module, args) -> None:
            if _in_backward():      # recomputation inside backward: gather, never release
                for idx in self._buckets_of_module(mid):
                    self._ensure(idx, prefer_secondary=True)
                return
            i = self._next
            if self._on_schedule and i < len(self.calls) and self.calls[i][0] == mid:
                self._next += 1
                for idx in self.calls[i][1]:
                    self._ensure(idx)
                self._prefetch(i + 1, +1)
                self._running[mid] = i
            else:
                self._on_schedule = False
                for idx in self._buckets_of_module(mid):
                    self._ensure(idx)
                self._running[mid] = None
        return hook

    def _make_post(self, mid: int):
        def hook(module, args, output) -> None:
            i = self._running.get(mid)
            if _in_backward():
                self._register_backward(frozenset(self._buckets_of_module(mid)), output)
                return
            buckets = self.calls[i][1] if i is not None else frozenset(self._buckets_of_module(mid))
            if torch.is_grad_enabled() or self.module.training:
                self._register_backward(buckets, output)
            if i is not None and self._on_schedule:
                self._release_many(self._release_after.get(i, ()), keep_secondary=self.module.training)
        return hook

    def _buckets_of_module(self, mid: int) -> Set[int]:
        out: Set[int] = set()
        for i in self._call_of_module.get(mid, ()):
            out |= self.calls[i][1]
        return out

    # -- backward -------------------------------------------------------------------------------------------------
    def _register_backward(self, buckets: frozenset, output) -> None:
        if not buckets:
            return
        fired = [-1]   # the backward (autograd graph task) that gathered them: once per backward, and again in a
                       # second backward through a retained graph (its weights were released after the first)

        def hook(grad):
            task = torch._C._current_graph_task_id()
            if fired[0] != task:
                fired[0] = task
                for idx in sorted(buckets):
                    self._ensure(idx, prefer_secondary=True)
            return grad

        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(hook)

    def on_bucket_grads_complete(self, b: Bucket) -> None:
        """All gradients of ``b`` are in: no op reads its weights again in this backward."""
        self._wait(b.index)
        if self.store.is_gathered(b.index):
            self.store.release(b)

    def on_backward_end(self) -> None:
        self._release_many([i for i in range(len(self.buckets)) if self.store.is_gathered(i) or i in self._works])

    # -- gathers ------------------------------------------------------------------------------------------------
    def _launch(self, idx: int, prefer_secondary: bool = False) -> None:
        b = self.buckets[idx]
        buf = self.store.acquire(b)
        if prefer_secondary and self.secondary_gather is not None and self.store.secondary_valid[idx]:
            work = self.secondary_gather(self.store.secondary_view(b), buf)
        else:
            work = self.backend.all_gather(self.store.shard_view(b, self.store.shard_rank), buf)
        self._works[idx] = (work, buf)

    def _wait(self, idx: int) -> None:
        entry = self._works.pop(idx, None)
        if entry is not None:
            work, buf = entry
            work.wait()
            self.store.materialize(self.buckets[idx], buf)

    def _ensure(self, idx: int, prefer_secondary: bool = False) -> None:
        if self.store.is_gathered(idx):
            return
        if idx not in self._works:
            self._launch(idx, prefer_secondary)
        self._wait(idx)

    def _prefetch(self, start: int, direction: int) -> None:
        if not self.overlap:
            return
        i = start
        while 0 <= i < len(self.calls):
            for idx in sorted(self.calls[i][1]):
                if self.store.is_gathered(idx) or idx in self._works:
                    continue
                if not self.store.has_room():
                    return
                self._launch(idx, prefer_secondary=direction < 0)
            i += direction

    def _release_many(self, idxs, keep_secondary: bool = False) -> None:
        for idx in sorted(idxs):
            self._wait(idx)
            b = self.buckets[idx]
            if self.store.is_gathered(idx):
                if keep_secondary:
                    self.store.keep_secondary(b)
                self.store.release(b)

    # -- the surface the ODO uses -----------------------------------------------------------------------------------
    def on_read(self, idx: int) -> None:
        if self._recorder is not None:
            self.note_use(idx)
        if not self.store.is_gathered(idx):
            self._ensure(idx, prefer_secondary=_in_backward())

    def _check_readable(self, keep_vars: bool) -> None:
        """``module.state_dict()`` issues no collective (callers run it on DP rank 0 only): it needs every bucket
        gathered already, by ``force_param_sync()`` or the wrapper's ``state_dict()`` on every rank. With
        ``keep_vars=True`` it hands out the parameters themselves (names and shapes are right, as checkpoint checks
        use them); their values must not be read while released."""
        if keep_vars:
            return
        released = [i for i in range(len(self.buckets)) if not self.store.is_gathered(i)]
        if released:
            raise RuntimeError(f"ZeRO-3: {len(released)} weight buckets are not gathered; call "
                               "force_param_sync() (or OverlappedDDP.state_dict()) on every DP rank before reading "
                               "the module's state_dict directly")

    def _after_load(self) -> None:
        """Loaded weights become the primary shards; gathered copies and hpZ pieces are stale."""
        for b in self.buckets:
            if self.store.is_gathered(b.index):
                self.store.write_back(b)
        self.release_all()
        self.store.invalidate_secondary()

    def launch(self) -> None:
        """After the optimizer wrote the primary shards: every gathered copy and secondary piece is stale."""
        self.wait_all()
        self._release_many([i for i in range(len(self.buckets)) if self.store.is_gathered(i)])
        self.store.invalidate_secondary()
        if not self.learning:
            self._prefetch(0, +1)   # the next forward's first buckets travel while the loop loads data

    def wait_all(self) -> None:
        """Complete the gathers in flight (they read the primary shards)."""
        for idx in sorted(self._works):
            self._wait(idx)

    def gather_all(self) -> None:
        """Every weight readable (state_dict, evaluation by hand, tests); kept until the next release point."""
        for idx in range(len(self.buckets)):
            self._ensure(idx)

    def release_all(self) -> None:
        self._release_many([i for i in range(len(self.buckets)) if self.store.is_gathered(i) or i in self._works])

    def enable_hooks(self) -> None:
        """The ZeRO-3 hooks are never off: without them no weight exists (megatron-core's toggle is ignored)."""

    def disable_hooks(self) -> None:
        """See :meth:`enable_hooks`."""

    @property
    def hooks_enabled(self) -> bool:
        return True

    @property
    def pending(self) -> int:
        return len(self._works)

    def in_flight(self) -> List[Work]:
        return [w for w, _ in self._works.values()]
