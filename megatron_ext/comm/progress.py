"""Progress engine: one per process and DP group, it issues, advances and completes the backends' works so that the
thread running forward and backward never blocks on a hop: on CPU a thread of its own that also runs the hops'
epilogues, on CUDA with NCCL the same rule run inline on the communication stream (see *CUDA* below).

[Note: progress engine]
*Why.* A hierarchical reduction (qgZ, ByteGrad) has dependent hops with local work between them (dequantize,
reduce, requantize). Driven from the training thread (``Work.advance()`` at each bucket launch), every hop blocks
backward on the previous one and the epilogues run there too; with 14 small buckets that costs more than the
overlap gains. On CUDA, ``wait()`` on an NCCL handle makes the *compute* stream wait, in the middle of backward.

*What.* The training thread only submits two kinds of commands into one FIFO: ``LAUNCH(w)`` (create the work:
quantize, issue the first hop) and ``COMPLETE(w)`` (sent the first time ``w.wait()`` is called). The engine thread
executes them strictly in FIFO order with a fixed rule:

* ``LAUNCH(k)``: run ``k``'s launch function (it issues ``k``'s first hop), then advance every older in-flight
  multi-phase work by one phase, oldest first (wait for its current hop, run the local work between hops, issue
  the next hop);
* ``COMPLETE(k)``: complete every in-flight work launched up to and including ``k`` -- also when ``k`` itself
  already finished (a single-phase work the engine completed while idle): whether older multi-phase works get
  their remaining hops here must not depend on how fast ``k``'s handle was. The multi-phase ones finish in rounds:
  each round advances every unfinished one launched up to ``k`` by one phase, oldest first, and then, unless that
  finished them all, every newer in-flight multi-phase work by one phase too (thread engine only, see *CUDA*); the
  single-phase ones up to ``k`` are then waited for. Finishing one work after the other put one hop at a time on
  the link, and each hop's gap (the engine waiting, adding, issuing the next) left it idle; in rounds the next
  work's hop travels meanwhile. The last round stops at the targets: the waiting thread is not held for a newer
  work's hop.

After each command, and whenever a single-phase work's handle finishes, the engine completes every single-phase
work whose handle has finished (``Work.ready``): this runs its epilogue (qwZ's decode, plain's averaging) ahead of
the consumer's ``wait()`` and issues nothing, so it may happen at any time. The engine learns that a handle
finished from the handle's future (``Work.notify_when_ready``: its done-callback enqueues a ``READY`` wake-up), and
sleeps otherwise; only works that cannot notify are polled every ``POLL_S``. Polling cost more than it saved: on a
loaded CPU each poll takes the GIL from the training thread, and a 1 ms poll doubled the forward pass of a
20-bucket ZeRO-2 step (4 ranks on 2 cores: 190 ms against 85 ms without the engine). The engine never blocks on a
single-phase work outside ``COMPLETE`` (a launch arriving meanwhile would wait: no two reduce-scatters in flight),
and never completes a multi-phase work while idle (that would issue its later hops at a time that depends on timing).

*What runs on it.* The gradient reductions (every stage of a sharding plan). The weight gathers do not: a gather
is one hop, issued after the step (ZeRO-3: at the hooks) and waited for where its bucket is needed, so the engine
has nothing to advance, and handing each wait to it cost a thread handoff per bucket (a 20-bucket ZeRO-2 step on
4 ranks sharing 2 cores spent 185 ms in forward with the gathers on the engine, 60-130 ms without). They stay on
the training thread, on the original optim group, which the engine never uses.

*Why the order is the same on every rank.* Every collective the engine issues is issued by one of those rules, so
the sequence of collectives on each group is a pure function of the command sequence. The commands are submitted at
the training thread's program points that were already required to be identical on every rank (buckets launched in
index order, completions where the optimizer, a hook or a full buffer pool waits), and ``COMPLETE`` is submitted
whether or not the work happens to be finished by then. Timing changes *when* the engine runs a command, never which
command comes next -- the collective order holds by construction, and the test injects random delays to check it.
The engine issues its collectives on its own clones of the DP group and subgroups
(:meth:`Topology.engine_clone`): the scalar all-reduces, broadcasts and hpZ copies the optimizer issues on the
training thread use the original groups, so the two threads never race on one group.

*Waiting.* ``EngineWork.wait()`` blocks on a completion event; ``done`` is true only once ``wait()`` has returned,
so callers that branch on it (``ChainedWork``) branch at the same point on every rank. ``advance()`` is the
inherited no-op: the engine advances. A failure on the engine thread (a kernel error, a collective timeout) is
stored; this and every later work re-raise it from ``wait()`` as :class:`ProgressEngineError`; the engine issues
nothing more. The peers' engines then fail at the collective timeout of the group: no rank waits forever.

*CUDA: the same rule, inline.* On CUDA with NCCL no hop blocks the host: ``wait()`` on an NCCL handle only makes the
current stream wait, and the kernels between hops are enqueued (:func:`runs_inline`). So the engine runs the same
FIFO rule *inline*, on the thread that submits the command (the autograd thread in backward, the training thread at
a wait), under a lock, with its communication stream current: every launch, advance and completion is enqueued on
that stream at once and the collective sequence is the thread engine's. (A work's later hops are still enqueued at
later commands, not all at its own launch: on one communication stream that would queue bucket k+1's quantization
and first hop behind bucket k's last hop.) A thread there only adds a handoff per command and contends for the GIL
with the gradient hooks. Inline, ``COMPLETE`` advances no newer work: nothing blocks, so there is no idle gap to
fill, and on one in-order stream a newer work's hop enqueued between the target's would only delay the done event
the consumer waits for (the rule is inline or not on every rank alike: device, backend and environment decide).
Traced on an H200 (``tools/trace_gpu_step.py``: 33 buckets of a 270M-parameter model, a
16-rank fake group, no link delay), a step took 57 / 54 ms inline against 74 / 72 ms with the thread for qwZ + qgZ
INT4 / ByteGrad (plain: 27 ms either way; no communication at all: 25 ms). With a 400 Gbit/s emulated link, or 8
buckets, plain was the same both ways; of six multi-hop comparisons the thread was 3-5% faster in four, equal in one
and 20% slower in one (ByteGrad, two buffers) -- one median of 5 steps each, within what one run can tell. With
``TORCH_NCCL_BLOCKING_WAIT`` set, or another backend for CUDA tensors, a ``wait()`` blocks the host, and the engine
keeps its thread.
At submission the training thread records an event on its current stream; the communication stream waits for it
before the launch, so the bucket is complete before it is read. NCCL ``wait()`` inside the engine makes the
communication stream (not the compute stream) wait; when a work completes the engine records a done event, and the
consumer's ``wait()`` makes *its* stream wait for that event -- the compute stream waits only where a result is
consumed (the step, a forward pre-hook, a full buffer pool handing a buffer over). Tensors handed to the engine are
``record_stream``-ed on the communication stream so the caching allocator keeps them alive until the
communication stream is past them. :class:`StreamOps` is the seam: ``CudaStreamOps`` does the above,
``NullStreamOps`` is the CPU no-op, and a test records the calls to check the order on a CPU-only machine; another
runs the inline engine on gloo (where it is synchronous) against the thread engine's weights.

*Exit.* At interpreter exit (``atexit``) every engine is stopped and joined: the single-hop works still in flight
(the gathers the last step launched for a forward that never comes) get up to ``STOP_WAIT_S`` to finish -- a gloo
work that finishes during the interpreter's finalisation frees its tensors on gloo's thread, which can no longer
take the GIL, and the process aborts ("terminate called without an active exception": a third of the runs of a
2-node job that did not call ``destroy_process_group``) --, then every work is dropped; nothing new is issued, and
a peer that is gone costs at most ``STOP_WAIT_S``. The weight gathers, issued on the training thread, get the same
deadline: their owners (``ParamSync``, ``ShardedParamSync``) register with :func:`drain_at_exit`. An inline engine
(CUDA) has no thread to stop and nothing of its own in flight: its works are NCCL's, and ``close()`` leaves them.

*Switch.* ``OverlapConfig.progress_engine`` (``--odo-progress-engine`` / ``--no-odo-progress-engine``, default from
``MEGATRON_EXT_PROGRESS_ENGINE``, on unless ``0``) -- off gives the synchronous path (``advance()`` on the training
thread), kept for comparison.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .backend import Work

_LAUNCH, _COMPLETE, _STOP, _READY = range(4)
POLL_S = 0.001   # while single-phase works are in flight, the idle engine looks at their handles this often
STOP_WAIT_S = 10.0   # at exit, how long the engine lets the handles in flight finish before dropping them

# Test hook: called on the engine thread before every command and every phase it advances (random delays).
_DELAY_HOOK: Optional[Callable[[str], None]] = None


def set_delay_hook(hook: Optional[Callable[[str], None]]) -> None:
    """Install ``hook(where)``, called on the engine thread before each command and phase (tests only)."""
    global _DELAY_HOOK
    _DELAY_HOOK = hook


def engine_enabled_by_default() -> bool:
    """``MEGATRON_EXT_PROGRESS_ENGINE=0`` turns the engine off (the synchronous path, for comparison)."""
    return os.environ.get("MEGATRON_EXT_PROGRESS_ENGINE", "1").strip().lower() not in ("0", "false", "off", "no")


class ProgressEngineError(RuntimeError):
    """A work failed on the progress engine's thread (the original exception is the ``__cause__``)."""


# -- streams --------------------------------------------------------------------------------------------------------
class StreamOps:
    """How the engine orders its work against the submitting thread's device stream (see the module note)."""

    def at_submit(self, tensors: Sequence[torch.Tensor]):
        """Training thread, at submission: a token the engine waits for before launching."""
        return None

    def before_launch(self, token) -> None:
        """Engine thread: make the communication stream wait for ``token``."""

    def context(self):
        """Engine thread: the context every launch, advance and completion runs in."""
        return _NULL_CONTEXT

    def at_done(self):
        """Engine thread, after a work completed: a token the consumer waits for."""
        return None

    def at_consume(self, token) -> None:
        """Consumer thread, in ``wait()``: make the current stream wait for ``token``."""


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


_NULL_CONTEXT = _NullContext()


class NullStreamOps(StreamOps):
    """CPU / gloo: works are complete when the engine says so; nothing to order on a device."""


class CudaStreamOps(StreamOps):
    """One communication stream per engine, ordered against the submitting stream by events.

    Streams are switched by device index (``current_stream(index)``, ``set_stream``): entering and leaving the
    ``torch.cuda.device`` and ``torch.cuda.stream`` context managers, which look the current device up again
    (through ``is_available()``), cost about 11 us per command on an H200 host, against 3 us for the index-based
    calls (run several times per bucket).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = torch.cuda.Stream(device=self.index)

    def at_submit(self, tensors: Sequence[torch.Tensor]):
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(self.stream)   # freed on the compute side: kept until the comm stream is past it
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.index))
        return ev

    def before_launch(self, token) -> None:
        if token is not None:
            self.stream.wait_event(token)

    def context(self):
        return _CudaContext(self.index, self.stream)

    def at_done(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def at_consume(self, token) -> None:
        if token is not None:
            torch.cuda.current_stream(self.index).wait_event(token)


class _CudaContext:
    """The engine's device and communication stream for one command, the caller's restored after it (a new thread
    starts on device 0 and its default stream; inline, the training thread's device is normally already ours)."""

    __slots__ = ("_index", "_stream", "_prev_device", "_prev_stream")

    def __init__(self, index: int, stream) -> None:
        self._index = index
        self._stream = stream

    def __enter__(self):
        current = torch.cuda.current_device()
        self._prev_device = current if current != self._index else None
        if self._prev_device is not None:
            torch.cuda.set_device(self._index)
        self._prev_stream = torch.cuda.current_stream(self._index)
        torch.cuda.set_stream(self._stream)
        return self

    def __exit__(self, *exc) -> bool:
        torch.cuda.set_stream(self._prev_stream)
        if self._prev_device is not None:
            torch.cuda.set_device(self._prev_device)
        return False


# -- works ----------------------------------------------------------------------------------------------------------
class EngineWork(Work):
    """The training thread's handle of a work the engine drives; ``wait()`` blocks on the engine's completion."""

    __slots__ = ("_engine", "_launch", "_token", "_inner", "_event", "_error", "_done_token", "_waited",
                 "_submitted_complete", "_seq", "_notified")

    def __init__(self, engine: "ProgressEngine", launch: Callable[[], Work], token) -> None:
        self._engine = engine
        self._launch = launch
        self._token = token
        self._inner: Optional[Work] = None
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._done_token = None
        self._waited = False
        self._submitted_complete = False
        self._seq = -1    # launch number, set by the engine thread
        self._notified = False   # single-phase and its handle will wake the engine (no polling)

    def wait(self) -> None:
        if self._waited:
            return
        if not self._submitted_complete:   # submitted at this program point on every rank, finished or not
            self._submitted_complete = True
            self._engine._put(_COMPLETE, self)
        self._event.wait()
        if self._error is not None:
            raise ProgressEngineError(f"the progress engine failed: {self._error!r}") from self._error
        self._engine.streams.at_consume(self._done_token)
        self._waited = True

    @property
    def done(self) -> bool:
        # Deterministic: True only after wait() returned on this thread (see the module note).
        return self._waited

    @property
    def finished(self) -> bool:
        """Whether the engine has completed it (timing-dependent: for reports and tests, never for control)."""
        return self._event.is_set()


class ProgressEngine:
    """A FIFO of LAUNCH / COMPLETE commands executed by one daemon thread, or ``inline`` by the submitting thread
    (CUDA with NCCL, where no command blocks the host; see the module note)."""

    def __init__(self, name: str = "megatron-ext-progress", streams: Optional[StreamOps] = None,
                 inline: bool = False, advance_newer: Optional[bool] = None) -> None:
        self.streams = streams if streams is not None else NullStreamOps()
        self.inline = inline
        # COMPLETE's rounds also advance newer works (None: on the thread engine only; see the module note)
        self.advance_newer = not inline if advance_newer is None else advance_newer
        self._queue: "queue.SimpleQueue[Tuple[int, object]]" = queue.SimpleQueue()
        self._inflight: List[EngineWork] = []
        self._error: Optional[BaseException] = None
        self._idle = threading.Condition()
        self._pending = 0          # commands submitted and not yet executed
        self.commands = 0          # executed commands (reports)
        self._launched = 0         # launches executed: each work's place in the FIFO order
        self._thread: Optional[threading.Thread] = None
        self._inline_lock = threading.RLock()
        self._inline_depth = 0     # inline: commands running on the lock's owner (a chained stage submits again)
        self._inline_owner: Optional[int] = None   # inline: the thread running a command
        if not inline:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # -- training thread ------------------------------------------------------------------------------------------
    def submit(self, launch: Callable[[], Work], tensors: Sequence[torch.Tensor] = ()) -> Work:
        """Enqueue ``launch`` (it creates a backend work and issues its first hop on the engine thread).

        ``tensors``: the inputs and outputs the work touches (kept alive across streams on CUDA). Called from the
        engine thread itself (a chained stage), ``launch`` runs at once and its work is returned as is.
        """
        if self.on_engine_thread():
            return launch()
        work = EngineWork(self, launch, self.streams.at_submit(tensors))
        self._put(_LAUNCH, work)
        return work

    def quiesce(self) -> None:
        """Block until every submitted command has run (e.g. before reading the ledger the engine writes)."""
        if self.on_engine_thread():
            return
        if self.inline:   # another thread may be inside a command
            with self._inline_lock:
                return
        with self._idle:
            while self._pending:
                self._idle.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the commands already submitted; in-flight works are dropped (see *Exit*)."""
        if self._thread is None or self.on_engine_thread() or not self._thread.is_alive():
            return
        self._put(_STOP, None)
        self._thread.join(timeout)

    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine running a command (its thread; inline: inside a command)."""
        if self.inline:
            return self._inline_depth > 0 and self._inline_owner == threading.get_ident()
        return threading.current_thread() is self._thread

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def _put(self, kind: int, work: Optional[EngineWork]) -> None:
        if self.inline:
            self._run_inline(kind, work)
            return
        with self._idle:
            self._pending += 1
        self._queue.put((kind, work))

    # -- engine thread --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            polling = self._error is None and any(not w._inner.multi_phase and not w._notified
                                                  for w in self._inflight)
            try:
                kind, work = self._queue.get(timeout=POLL_S if polling else None)
            except queue.Empty:   # idle: finish single-phase works whose handles are done (issues nothing)
                self._complete_ready()
                continue
            if kind == _READY:    # a handle finished (its future's callback): not a command of the FIFO
                if self._error is None:
                    self._complete_ready()
                continue
            if kind == _STOP:
                self._stop()
                return
            try:
                self._command(kind, work)
            finally:
                self.commands += 1
                with self._idle:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.notify_all()

    def _run_inline(self, kind: int, work: EngineWork) -> None:
        """Inline (CUDA): the command runs now, on the submitting thread, exactly as the engine thread would run it."""
        with self._inline_lock:
            if self._inline_depth and kind == _COMPLETE:
                # a wait() inside a command would complete works the running command is still advancing (the
                # thread engine would deadlock on its own queue): a programming error, surfaced at the next wait()
                raise ProgressEngineError("a progress-engine work was waited for inside an engine command")
            self._inline_depth += 1
            self._inline_owner = threading.get_ident()
            try:
                self._command(kind, work)
            finally:
                self._inline_depth -= 1
                if not self._inline_depth:
                    self._inline_owner = None
                self.commands += 1

    def _command(self, kind: int, work: EngineWork) -> None:
        """One FIFO command, then the single-phase works it let finish; after a failure every work fails."""
        if self._error is None:
            self._execute(kind, work)
            self._complete_ready()
        if self._error is not None:
            self._fail_all(work)

    def _execute(self, kind: int, work: EngineWork) -> None:
        hook = _DELAY_HOOK
        try:
            with self.streams.context():
                if hook is not None:
                    hook("launch" if kind == _LAUNCH else "complete")
                if kind == _LAUNCH:
                    self.streams.before_launch(work._token)
                    launch, work._launch = work._launch, None
                    work._inner = launch()
                    if not work._inner.multi_phase and not self.inline:   # inline: checked after each command
                        work._notified = work._inner.notify_when_ready(self._wake)
                    work._seq = self._launched
                    self._launched += 1
                    self._inflight.append(work)
                    for older in list(self._inflight[:-1]):   # one phase each, oldest first
                        if older._inner.multi_phase:
                            if hook is not None:
                                hook("advance")
                            older._inner.advance()
                    self._retire_finished()
                elif kind == _COMPLETE:
                    self._complete_upto(work._seq, hook)
                    self._retire_finished()
        except BaseException as e:  # noqa: BLE001 -- surfaced on the training thread at the next wait()
            if self.inline and not isinstance(e, Exception):
                raise   # Ctrl-C / SystemExit on the training thread itself: not the engine's failure
            self._error = e

    def _complete_upto(self, seq: int, hook) -> None:
        """``COMPLETE``: rounds of one phase per in-flight multi-phase work until those launched up to launch number
        ``seq`` are done, then wait for the single-phase ones up to it (see the module note).

        By launch number, not by membership: the work waited for may have been retired while idle (timing). Which
        works advance in a round depends only on multi-phase works' ``done``, which only the rule's advances change.
        """
        while True:
            multi = [w for w in self._inflight if w._inner.multi_phase and not w._inner.done]
            targets = [w for w in multi if w._seq <= seq]
            if not targets:
                break
            for w in targets:
                if hook is not None:
                    hook("advance")
                w._inner.advance()
            if all(w._inner.done for w in targets):
                break   # the last round: the caller is waiting; newer works' hops would only delay it
            if not self.advance_newer:
                continue   # inline: one in-order stream, a newer hop would delay the targets' done event
            for w in multi[len(targets):]:   # launched after seq: one phase, while the targets' hops travel
                if hook is not None:
                    hook("advance")
                w._inner.advance()
        for w in list(self._inflight):
            if w._seq > seq:
                break
            if not w._inner.done:
                if hook is not None:
                    hook("advance")
                w._inner.wait()

    def _wake(self) -> None:
        """A handle finished (called on the backend's thread): let the engine complete it."""
        self._queue.put((_READY, None))

    def _complete_ready(self) -> None:
        """Complete the single-phase works whose handles have finished (issues nothing: timing may decide)."""
        try:
            ready = [w for w in self._inflight if w._inner.ready]
            if not ready:   # the usual case after a launch: nothing to complete, no stream switch
                if self._error is not None:   # the command failed: what it finished first still succeeds
                    self._retire_finished()
                return
            with self.streams.context():
                for w in ready:
                    w._inner.wait()
                self._retire_finished()
        except BaseException as e:  # noqa: BLE001 -- surfaced at the next wait()
            if self.inline and not isinstance(e, Exception):
                raise
            self._error = e
            self._fail_all(None)

    def _stop(self) -> None:
        # Let the handles in flight finish (bounded: a peer may be gone): a gloo work still running at interpreter
        # finalisation frees its tensors on gloo's thread, which cannot take the GIL any more -> std::terminate.
        let_finish([w._inner for w in self._inflight if not w._inner.multi_phase], time.monotonic() + STOP_WAIT_S)
        if self._error is None:
            self._error = ProgressEngineError("the progress engine was closed (interpreter exit)")
        self._fail_all(None)
        with self._idle:
            self._pending = 0
            self._idle.notify_all()

    def _retire_finished(self) -> None:
        still: List[EngineWork] = []
        for w in self._inflight:
            if w._inner.done:
                w._inner = None
                w._done_token = self.streams.at_done()
                w._event.set()
            else:
                still.append(w)
        self._inflight = still

    def _fail_all(self, work: Optional[EngineWork]) -> None:
        """After a failure: every in-flight and every later work completes with the error (nothing is issued)."""
        victims = list(self._inflight)
        if work is not None and work not in victims:
            victims.append(work)
        self._inflight = []
        for w in victims:
            if not w._event.is_set():
                w._error = self._error
                w._launch = w._inner = None
                w._event.set()


# -- one engine per process and DP group ----------------------------------------------------------------------------
_ENGINES: Dict[tuple, ProgressEngine] = {}
_ENGINES_LOCK = threading.Lock()


def runs_inline(device: torch.device, backend: str) -> bool:
    """Inline on CUDA with NCCL, whose ``wait()`` only orders streams; on a thread of its own elsewhere: CPU, another
    backend for CUDA tensors, or ``TORCH_NCCL_BLOCKING_WAIT`` (a ``wait()`` that blocks the host)."""
    blocking = any(os.environ.get(v, "0").strip().lower() not in ("0", "", "false")
                   for v in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"))
    return device.type == "cuda" and "nccl" in backend.lower() and not blocking


def engine_for(key: tuple, device: torch.device, backend: str) -> ProgressEngine:
    """The process's engine for the DP group ``key`` (shared by every wrapper over that group, e.g. virtual
    pipeline chunks, so their launches share one FIFO); ``backend``: the group's (``dist.get_backend``)."""
    inline = runs_inline(device, backend)
    with _ENGINES_LOCK:
        eng = _ENGINES.get((key, inline))
        if eng is None:
            _register_exit()
            streams: StreamOps = CudaStreamOps(device) if device.type == "cuda" else NullStreamOps()
            eng = _ENGINES[(key, inline)] = ProgressEngine(streams=streams, inline=inline)
        return eng


def close_all() -> None:
    """Stop every engine of the process (registered with ``atexit``; see *Exit* in the module note)."""
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for eng in engines:
        eng.close()


# -- interpreter exit -----------------------------------------------------------------------------------------------
_DRAINED: "weakref.WeakSet" = weakref.WeakSet()   # owners of works issued outside the engines (the weight gathers)
_EXIT_REGISTERED = False


def _register_exit() -> None:
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        _EXIT_REGISTERED = True
        atexit.register(_at_exit)


def drain_at_exit(owner) -> None:
    """At interpreter exit, let ``owner.in_flight()`` (single-hop works issued on the training thread) finish
    within ``STOP_WAIT_S``, as the engines' own (see *Exit* in the module note)."""
    _register_exit()
    _DRAINED.add(owner)


def let_finish(works: Sequence[Work], deadline: float) -> None:
    """Wait (polling, not blocking in a collective: a peer may be gone) until each work is ready or ``deadline``."""
    for w in works:
        while not w.ready and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _at_exit() -> None:
    close_all()
    deadline = time.monotonic() + STOP_WAIT_S
    for owner in list(_DRAINED):
        let_finish(owner.in_flight(), deadline)
