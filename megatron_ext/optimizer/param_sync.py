"""Parameter path: per-bucket all-gather into the ParameterBuffer, waited for just before a weight is read.

[Note: no stale reads]
After the optimizer step every bucket's all-gather is launched in forward order and waited for lazily, so the
gathers overlap the forward. Three mechanisms together guarantee that no weight is read while its bucket is in
flight, whatever the module structure:

1. A forward pre-hook on every module that owns parameters waits for the buckets of those parameters (like
   megatron-core's DDP); this covers the common case and anything the module does with its own parameters.
2. Every owner's ``_parameters`` mapping is replaced by a read guard: ``Module.__getattr__`` fetches parameters
   through it, so *any* read by attribute -- a parent reading a child's weight before the child runs, a tied
   output layer, user code between steps -- waits for exactly that parameter's bucket, at the moment of the read.
   The check is one dict lookup, and it follows the model's control flow step by step (no learned schedule).
3. Reads that bypass attributes (``module.parameters()`` iterated by another module, a stored reference) are found
   once, in the first forward: it waits for everything at the root, while a ``TorchFunctionMode`` audits every op
   and notes each parameter consumed before mechanisms 1 and 2 would have waited for it. Those buckets are waited
   for at the root's pre-hook from then on (they lose overlap, never correctness). The audit stays out of
   ``torch.compile``'d regions (see ``ParamUseAudit``), so the audited forward computes exactly what the others do.
   The rule that follows: a compiled region must get the weights it reads as arguments or through their owners'
   attributes (megatron-core's fused functions take them as arguments, read by attribute outside). A weight that
   compiled code reaches through a stored reference or another module's ``parameters()`` is not audited, and a
   later forward may read it while its gather is in flight.

Anything that writes weights (step, load) or reads them in bulk (state_dict) calls ``wait_all()`` first.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..comm.backend import ParamGather, Work
from ..comm.progress import drain_at_exit
from .bucketing import Bucket
from .param_buffer import ParameterBuffer


class _ReadGuardedParameters(dict):
    """A module's ``_parameters`` that waits for a parameter's in-flight all-gather when it is fetched."""

    __slots__ = ("_mx_sync", "_mx_bucket_of")

    def __getitem__(self, name: str) -> Optional[torch.nn.Parameter]:
        p = dict.__getitem__(self, name)
        idx = self._mx_bucket_of.get(name)
        if idx is not None:
            self._mx_sync.on_read(idx)
        return p

    def __reduce__(self):
        # Copies and pickles of the module get a plain dict, detached from this optimizer.
        return (dict, (dict(self),))


def owner_buckets(module: torch.nn.Module, bucket_of_param: Dict[int, int]) -> Dict[int, Set[int]]:
    """``{id(m): buckets of the parameters m owns}`` for every module that owns bucketed parameters."""
    out: Dict[int, Set[int]] = {}
    for m in module.modules():
        own = {bucket_of_param[id(p)] for p in m._parameters.values() if p is not None and id(p) in bucket_of_param}
        if own:
            out[id(m)] = own
    return out


def guard_parameter_reads(module: torch.nn.Module, bucket_of_param: Dict[int, int], sync) -> None:
    """Replace every owner's ``_parameters`` by a read guard calling ``sync.on_read(bucket)`` (mechanism 2)."""
    for m in module.modules():
        if isinstance(m._parameters, _ReadGuardedParameters):
            continue
        bucket_of = {n: bucket_of_param[id(p)] for n, p in m._parameters.items()
                     if p is not None and id(p) in bucket_of_param}
        if not bucket_of:
            continue
        guarded = _ReadGuardedParameters(m._parameters)
        guarded._mx_sync = sync
        guarded._mx_bucket_of = bucket_of
        m._parameters = guarded


class ParamUseAudit(TorchFunctionMode):
    """Calls ``on_use(bucket)`` for every bucketed parameter an op consumes (the first forward's audit).

    Transparent to ``torch.compile``: while Dynamo traces a function under it (Megatron's fused bias-dropout-add and
    bias-GeLU are compiled), the mode only calls the op. Inspecting the arguments there would be traced too: ``id()``
    of each tensor becomes an identity guard, so every call recompiles, and once Dynamo's recompile limit is hit the
    function's later calls run eagerly. That changed the model's numerics from the first audited forward on (one
    GPU, bf16: a resumed run, audited at another iteration, then logged other losses). A compiled region's weights
    come in as its arguments, fetched outside it (by attribute, where mechanism 2 waits for them); what compiled code
    reaches otherwise is not seen (the rule in [Note: no stale reads]).
    """

    def __init__(self, bucket_of_param: Dict[int, int], on_use) -> None:
        super().__init__()
        self.bucket_of_param = bucket_of_param
        self.on_use = on_use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        for leaf in tree_leaves((args, kwargs)):
            idx = self.bucket_of_param.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if idx is not None:
                self.on_use(idx)
        return func(*args, **kwargs)


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
        self.bucket_of_param: Dict[int, int] = {id(p): b.index for b in buckets for p in b.params}
        self._owner_buckets = owner_buckets(module, self.bucket_of_param)
        self.learning = True                  # the first forward audits reads (mechanism 3)
        self.covered: Set[int] = set()        # buckets mechanisms 1-2 have waited for so far in that forward
        self.root_buckets: Set[int] = set()   # buckets read outside mechanisms 1-2: waited for at the root
        self._audit: Optional[ParamUseAudit] = None
        self._handles: List = []
        # Called before every forward of the root, whether the waiting hooks are on or off (the speculative step's
        # abort: a forward between a backward and its step, see speculative_step.py).
        self.before_forward: Optional[Callable[[], None]] = None
        module.register_forward_pre_hook(self._before_forward_hook, prepend=True)
        # Called before the module loads a state dict (the speculative step's abort), which then waits for the
        # gathers in flight: none may land on the loaded weights.
        self.before_load: Optional[Callable[[], None]] = None
        module.register_load_state_dict_pre_hook(self._before_load_hook)
        drain_at_exit(self)   # the last step's gathers may still be in flight when the interpreter exits
        # module.state_dict() iterates _parameters without the read guard: it waits for the gathers itself
        module.register_state_dict_pre_hook(lambda *_: self.wait_all())
        if overlap:
            self._guard_parameter_reads()
            self.enable_hooks()

    def _guard_parameter_reads(self) -> None:
        guard_parameter_reads(self.module, self.bucket_of_param, self)

    # -- hooks --------------------------------------------------------------------------------------
    def enable_hooks(self) -> None:
        if self._handles:
            return
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_hook, prepend=True))
        self._handles.append(self.module.register_forward_hook(self._root_post_hook, always_call=True))
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

    def _before_load_hook(self, *unused) -> None:
        if self.before_load is not None:
            self.before_load()
        self.wait_all()

    def _before_forward_hook(self, module, args) -> None:
        if self.before_forward is not None:
            self.before_forward()

    def _root_pre_hook(self, module, args) -> None:
        self._before_forward_hook(module, args)   # first: an abort launches gathers this hook must then see
        if self.learning and self._audit is None:
            self.wait_all()  # nothing is read stale while the audit learns
            self._audit = ParamUseAudit(self.bucket_of_param, self._note_uncovered)
            self._audit.__enter__()
            return
        for idx in self.root_buckets:
            self.wait_bucket(idx)

    def _note_uncovered(self, idx: int) -> None:
        """A weight consumed before mechanisms 1-2 waited for its bucket: wait for it at the root from now on."""
        if idx not in self.covered:
            self.root_buckets.add(idx)
            self.covered.add(idx)

    def _root_post_hook(self, module, args, output) -> None:
        if self._audit is not None:
            audit, self._audit = self._audit, None
            audit.__exit__(None, None, None)
            self.learning = False
            self.covered = set()

    def _make_pre_hook(self, mid: int):
        def hook(module, args) -> None:
            for idx in self._owner_buckets[mid]:
                self.on_read(idx)
        return hook

    def on_read(self, idx: int) -> None:
        """A parameter of bucket ``idx`` is about to be read: wait for its gather if it is in flight."""
        if self._audit is not None:
            self.covered.add(idx)
        if idx in self._work:
            self.wait_bucket(idx)

    # -- gathers ------------------------------------------------------------------------------------
    def launch(self) -> None:
        """All-gather every bucket (forward order); waited for lazily when hooks are on, eagerly otherwise."""
        self.wait_all()
        for b in self.forward_order:
            self._work[b.index] = self.backend.all_gather(self.param_buffer.shard_view(b, self.rank),
                                                          self.param_buffer.bucket_view(b))
        if not (self.overlap and self.hooks_enabled):
            self.wait_all()

    def launch_buckets(self, buckets: Sequence[Bucket], backend: Optional[ParamGather] = None) -> None:
        """All-gather ``buckets`` in the order given over ``backend`` (default: this sync's), leaving the other
        buckets' gathers in flight; each is waited for where its weights are read, like :meth:`launch`'s."""
        backend = backend if backend is not None else self.backend
        for b in buckets:
            self.wait_bucket(b.index)
            self._work[b.index] = backend.all_gather(self.param_buffer.shard_view(b, self.rank),
                                                     self.param_buffer.bucket_view(b))
        if not (self.overlap and self.hooks_enabled):
            for b in buckets:   # nothing would wait before a read: as launch()
                self.wait_bucket(b.index)

    def gathering(self, idx: int) -> bool:
        """Whether bucket ``idx``'s gather is in flight and not yet finished (timing-dependent: for pacing only)."""
        w = self._work.get(idx)
        return w is not None and not w.ready

    def wait_bucket(self, idx: int) -> None:
        w = self._work.pop(idx, None)
        if w is not None:
            w.wait()

    def wait_all(self) -> None:
        for b in self.forward_order:
            self.wait_bucket(b.index)

    def gather_all(self) -> None:
        """Every weight readable (ZeRO-2 keeps full weights: the in-flight gathers are all there is to wait for)."""
        self.wait_all()

    def release_all(self) -> None:
        """ZeRO-2 keeps its full weights: nothing to release."""

    @property
    def pending(self) -> int:
        return len(self._work)

    def in_flight(self) -> List[Work]:
        return list(self._work.values())
