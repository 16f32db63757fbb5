"""The ODO's two collectives behind one small interface, and the registry that maps setting names to backends.

[Note: contract]
``GradReduce.reduce_scatter(bucket, out_shard)`` takes a 1-D bucket of ``P * n`` elements laid out identically on
every rank of the DP group and writes this rank's ``n``-element shard of the *average* over the group into
``out_shard`` (overwriting it). Averaging happens exactly once, inside the backend.

``ParamGather.all_gather(shard, out_bucket)`` writes every rank's ``n``-element shard into
``out_bucket[r*n:(r+1)*n]``; ``shard`` may alias this rank's own slice of ``out_bucket``. After ``wait()`` every
rank holds bit-identical ``out_bucket`` contents (a lossy backend overwrites the owner's slice with the decoded
value too).

Both return a :class:`Work` whose ``wait()`` completes the operation; until then neither tensor may be touched.
Backends choose the alignment a shard must have (``shard_alignment``, in elements); the optimizer pads buckets
to it. Backends record every byte they send in the ledger.

[Note: advancing multi-phase work]
A hierarchical operation has dependent phases (qgZ: intra-node hop, then inter-node hop; ByteGrad: reduce to the
leader, leaders' all-to-all, leaders' all-gather, broadcast). Only the first is launched when the operation is
created; ``Work.advance()`` finishes the current phase (a blocking wait on its handles) and launches the next, so
the caller can put the later hops in flight while it still computes (the ODO advances its in-flight buckets each
time it launches a new one, during backward). ``wait()`` advances until done. Every rank must call ``advance()``
at the same points of its program (never depending on timing, e.g. on polling a handle), because each phase
issues collectives on shared groups in the same order on every rank. Results do not depend on when, or whether,
``advance()`` is called.

With the progress engine (progress.py) the ODO never calls ``advance()`` itself: the engine thread does, at the
same points of its command sequence on every rank (see [Note: progress engine]).
"""
from __future__ import annotations

import abc
import queue
import threading
import dataclasses
from typing import Callable, ClassVar, Dict, List, Optional, Type

import torch
import torch.distributed as dist

from .ledger import CommLedger
from .topology import Topology, warn_once



@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Knobs of the quantizing backends (ignored by ``plain``)."""

    quant_group_size: int = 2048     # elements per fp32 scale (qwZ, qgZ)
    qgz_bits: int = 4                # 4 or 8
    qgz_pipeline_stages: int = 2     # chunks of a bucket whose intra/inter-node phases are pipelined
    bytegrad_chunk_size: int = 0     # 0: one (min, max) per all-to-all chunk

    def __post_init__(self) -> None:
        if self.quant_group_size <= 0:
            raise ValueError(f"quant_group_size (--quant-group-size) must be > 0, got {self.quant_group_size}")
        if self.qgz_bits not in (4, 8):
            raise ValueError(f"qgz_bits (--qgz-bits) must be 4 or 8, got {self.qgz_bits}")
        if self.qgz_pipeline_stages < 1:
            raise ValueError(f"qgz_pipeline_stages must be >= 1, got {self.qgz_pipeline_stages}")


class Work(abc.ABC):
    """Handle of an asynchronous backend operation."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Complete the operation (every remaining phase); idempotent."""

    def advance(self) -> None:
        """Finish the current phase (blocking wait on its handles) and launch the next one.

        No-op when the operation is done or has a single phase (this default). See [Note: advancing multi-phase
        work]: call it at the same program point on every rank.
        """
        return None

    @property
    def multi_phase(self) -> bool:
        """Whether ``advance()`` does anything (single-phase works only complete in ``wait()``)."""
        return type(self).advance is not Work.advance

    @property
    def ready(self) -> bool:
        """``wait()`` would neither block nor issue a collective (a finished single-phase handle): the progress
        engine may complete it at any moment, whatever the timing. False when unknown."""
        return False

    def notify_when_ready(self, callback: Callable[[], None]) -> bool:
        """Arrange for ``callback()`` (from any thread) once :attr:`ready` may have turned true, so the progress
        engine can sleep instead of polling; False when this work cannot (the engine then polls it)."""
        return False

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """Every phase has run and completed."""


class CompletedWork(Work):
    """An operation that finished at launch (one rank, empty bucket)."""

    def wait(self) -> None:
        return None

    @property
    def ready(self) -> bool:
        return True

    @property
    def done(self) -> bool:
        return True


class TorchWork(Work):
    """A torch.distributed handle, optionally followed by a local epilogue run once on ``wait()``.

    Single-phase: ``advance()`` is the inherited no-op (the epilogue is local work that ``wait()`` runs).
    """

    def __init__(self, handle, epilogue: Optional[Callable[[], None]] = None) -> None:
        self._handle = handle
        self._epilogue = epilogue
        self._done = False
        self._signalled = False
        self._reaped: Optional[threading.Lock] = None   # set when _REAPER waits for the handle too
        self._handle_result: Optional[BaseException] = None
        self._handle_waited = False

    def _wait_handle(self) -> None:
        """The handle's ``wait()``, once: gloo's reduce-scatter gives wrong sums when two threads wait for it at once
        (seen with torch 2.13), so with the reaper watching, the first waiter waits and the other takes its
        outcome."""
        if self._reaped is None:
            self._handle.wait()
            return
        with self._reaped:
            if not self._handle_waited:
                self._handle_waited = True
                try:
                    self._handle.wait()
                except BaseException as e:  # noqa: BLE001 -- raised again where the consumer waits
                    self._handle_result = e
        if self._handle_result is not None:
            raise self._handle_result

    def wait(self) -> None:
        if self._done:
            return
        if self._handle is not None:
            self._wait_handle()
            self._handle = None    # the last reference is dropped here, with the GIL, not on the backend's thread
        if self._epilogue is not None:
            self._epilogue()
            self._epilogue = None   # its tensors go with it, whoever still holds this work
        self._done = True

    @property
    def done(self) -> bool:
        return self._done

    @property
    def ready(self) -> bool:
        return self._done or self._handle is None or self._signalled or self._handle.is_completed()

    def notify_when_ready(self, callback: Callable[[], None]) -> bool:
        if self._handle is None:
            return False

        def finished(_future=None) -> None:
            self._signalled = True
            callback()

        try:
            future = self._handle.get_future()
        except (AttributeError, RuntimeError):   # no future (gloo's reduce-scatter): waited for on a thread
            self._reaped = threading.Lock()
            _REAPER.watch(self, finished)
            return True
        future.add_done_callback(finished)
        return True


class _HandleReaper:
    """Waits, on a daemon thread of its own, for the handles that cannot report that they finished: gloo's
    reduce-scatter has no future, and its ``is_completed()`` stays false until ``wait()`` (torch 2.13). Without it
    the progress engine polled them every millisecond (each poll takes the GIL from the training thread) and still
    learnt of them only at their ``COMPLETE``; the speculative step could not hand their buckets over in backward.
    The thread only waits (a second ``wait()`` returns at once, or raises the stored error where the consumer waits)
    and never issues anything. Handles are waited for in the order they are watched: a later one that finishes
    first is reported when the older ones are."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def watch(self, work: "TorchWork", on_done: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="megatron-ext-handle-reaper", daemon=True)
                self._thread.start()
        self._queue.put((work, on_done))

    def _run(self) -> None:
        while True:
            work, on_done = self._queue.get()
            try:
                if work._handle is not None:
                    work._wait_handle()
            except BaseException:  # noqa: BLE001 -- the consumer's own wait() raises it
                pass
            on_done()
            work = on_done = None   # nothing of a finished work stays alive here (its buffers are the pool's)


_REAPER = _HandleReaper()


class StagedWork(Work):
    """Several dependent phases; each phase is a callable returning the handles the next phase must wait for.

    The first phase is launched at construction; ``advance()`` waits for the current phase's handles and launches
    the next one; ``wait()`` advances until every phase has run and its handles are complete.
    """

    def __init__(self, phases: List[Callable[[], List]]) -> None:
        self._phases = list(phases)
        self._pending: List = []
        self._done = False
        self.advance()

    def advance(self) -> None:
        if self._done:
            return
        for h in self._pending:
            h.wait()
        self._pending = []
        if self._phases:
            self._pending = self._phases.pop(0)() or []
        if not self._phases and not self._pending:
            self._done = True

    def wait(self) -> None:
        while not self._done:
            self.advance()

    @property
    def done(self) -> bool:
        return self._done


class ChainedWork(Work):
    """Works that run one after another: each stage is a callable that launches a Work once the previous stage
    has completed (e.g. a reduce-scatter inside the optim group, then an all-reduce across its replicas).

    ``advance()`` advances the current stage by one phase (a single-phase stage is completed), and launches the
    next stage as soon as the current one is done, so a chain moves as far as one hop per call.
    """

    def __init__(self, stages: List[Callable[[], Work]]) -> None:
        self._stages = list(stages)
        self._current: Optional[Work] = self._stages.pop(0)()
        self._launch_next_if_done()

    def _launch_next_if_done(self) -> None:
        while self._current is not None and self._current.done:
            self._current = self._stages.pop(0)() if self._stages else None

    def advance(self) -> None:
        if self._current is None:
            return
        if self._current.multi_phase:
            self._current.advance()
        else:
            self._current.wait()
        self._launch_next_if_done()

    def wait(self) -> None:
        while self._current is not None:
            self._current.wait()
            self._launch_next_if_done()

    @property
    def done(self) -> bool:
        return self._current is None


class _Backend(abc.ABC):
    name: ClassVar[str] = "?"

    def __init__(self, topology: Topology, ledger: CommLedger, options: BackendOptions) -> None:
        self.topology = topology
        self.ledger = ledger
        self.options = options

    @property
    def shard_alignment(self) -> int:
        """Elements a shard length must be a multiple of."""
        return 1

    def _warn_once(self, msg: str) -> None:
        """Log ``msg`` once per job: only DP rank 0 of the group logs, and only once per process; of several DP
        groups (TP/PP > 1), only the one holding global rank 0 (their backends are alike)."""
        if self.topology.rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            warn_once(msg)


class GradReduce(_Backend):
    @abc.abstractmethod
    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work: ...

    def _local_reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Optional[Work]:
        """Checks a reduce-scatter's sizes; the finished work when nothing needs sending (one rank, empty shard)."""
        P, n = self.topology.size, out_shard.numel()
        if bucket.numel() != n * P:
            raise ValueError(f"bucket of {bucket.numel()} elements does not split into {P} shards of {n}")
        if P == 1:
            out_shard.copy_(bucket)
            return CompletedWork()
        return CompletedWork() if n == 0 else None

    @property
    def all_reduce_alignment(self) -> int:
        """Elements a tensor given to :meth:`all_reduce` must be a multiple of."""
        return self.topology.size * self.shard_alignment

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """Average ``tensor`` over the group in place; every rank ends with bit-identical values.

        Default: this backend's reduce-scatter, then an all-gather of the averaged pieces (:meth:`_gather_piece`).
        """
        topo = self.topology
        if topo.size == 1:
            return CompletedWork()
        n = tensor.numel() // topo.size
        if n * topo.size != tensor.numel():
            raise ValueError(f"all_reduce of {tensor.numel()} elements does not split into {topo.size} pieces")
        piece = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
        return ChainedWork([lambda: self.reduce_scatter(tensor, piece),
                            lambda: self._gather_piece(piece, tensor)])

    def _gather_piece(self, piece: torch.Tensor, out: torch.Tensor) -> Work:
        """All-gather the averaged pieces into ``out`` (full precision; quantizing backends override)."""
        from .plain import all_gather_recorded
        return all_gather_recorded(self.topology, self.ledger, piece, out, "all_reduce_all_gather")


class ParamGather(_Backend):
    @abc.abstractmethod
    def all_gather(self, shard: torch.Tensor, out_bucket: torch.Tensor) -> Work: ...


GRAD_REDUCE_BACKENDS: Dict[str, Type[GradReduce]] = {}
PARAM_GATHER_BACKENDS: Dict[str, Type[ParamGather]] = {}


def register_grad_reduce(name: str):
    def deco(cls: Type[GradReduce]) -> Type[GradReduce]:
        cls.name = name
        GRAD_REDUCE_BACKENDS[name] = cls
        return cls
    return deco


def register_param_gather(name: str):
    def deco(cls: Type[ParamGather]) -> Type[ParamGather]:
        cls.name = name
        PARAM_GATHER_BACKENDS[name] = cls
        return cls
    return deco


def build_grad_reduce(name: str, topology: Topology, ledger: CommLedger, options: BackendOptions) -> GradReduce:
    _import_builtin_backends()
    if name not in GRAD_REDUCE_BACKENDS:
        raise ValueError(f"grad_reduce (--grad-reduce) must be one of {sorted(GRAD_REDUCE_BACKENDS)}, got {name!r}")
    return GRAD_REDUCE_BACKENDS[name](topology, ledger, options)


def build_param_gather(name: str, topology: Topology, ledger: CommLedger, options: BackendOptions) -> ParamGather:
    _import_builtin_backends()
    if name not in PARAM_GATHER_BACKENDS:
        raise ValueError(
            f"param_gather (--param-gather) must be one of {sorted(PARAM_GATHER_BACKENDS)}, got {name!r}")
    return PARAM_GATHER_BACKENDS[name](topology, ledger, options)


def available_grad_reduce() -> List[str]:
    _import_builtin_backends()
    return sorted(GRAD_REDUCE_BACKENDS)


def available_param_gather() -> List[str]:
    _import_builtin_backends()
    return sorted(PARAM_GATHER_BACKENDS)


def _import_builtin_backends() -> None:
    # Importing a backend module registers it; quantized backends are optional modules added later.
    import importlib

    for mod in ("plain", "qwz", "qgz", "bytegrad", "ring"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{mod}":
                raise
