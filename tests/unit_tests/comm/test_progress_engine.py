"""The progress engine (megatron_ext/comm/progress.py): the FIFO rule in one process with fake works (order under
random delays, errors surfacing at wait, the CUDA stream seam), and the ODO at DP=4 on 2 simulated nodes: 50 steps
with random delays injected into the engine thread give bit-identical weights to the synchronous path (no engine,
no delays), for every hierarchical backend and a plan with replicas (chained works), and never hang; the engine
without delays is the inline engine's cases here and the backends' own tests with the engine on."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_ext.comm.backend import Work
from megatron_ext.comm.progress import ProgressEngine, ProgressEngineError, StreamOps, set_delay_hook
from unit_tests.comm import _worlds as W
from unit_tests.dist_harness import run_distributed


class _FakeWork(Work):
    """``phases`` hops; each issue is logged as (name, hop) -- the stand-in for a collective on a group."""

    def __init__(self, name: str, phases: int, log: list, fail_at: int = -1) -> None:
        self.name, self.phases, self.log, self.fail_at = name, phases, log, fail_at
        self.hop = 0
        self._issue()

    def _issue(self) -> None:
        if self.hop == self.fail_at:
            raise ValueError(f"{self.name} failed at hop {self.hop}")
        self.log.append((self.name, self.hop, threading.current_thread().name))

    def advance(self) -> None:
        if self.hop < self.phases:
            self.hop += 1
            if self.hop < self.phases:
                self._issue()

    def wait(self) -> None:
        while self.hop < self.phases:
            self.advance()

    @property
    def done(self) -> bool:
        return self.hop >= self.phases


def _program(engine: ProgressEngine, log: list) -> None:
    """A backward-like program: launches in order, a wait in the middle (full pool), then the step's waits."""
    works = []
    for k in range(8):
        works.append(engine.submit(lambda k=k: _FakeWork(f"b{k}", 1 + k % 3, log)))
        if k == 4:
            works[1].wait()
    for w in works:
        w.wait()


def test_issue_order_is_a_function_of_the_commands_only():
    reference: list = []
    _program(ProgressEngine(), reference)
    assert all(t.startswith("megatron-ext-progress") for _, _, t in reference), "issued off the engine thread"
    rng = random.Random(0)
    try:
        for _ in range(15):
            set_delay_hook(lambda where: time.sleep(rng.random() * 0.002) if rng.random() < 0.5 else None)
            log: list = []
            _program(ProgressEngine(), log)
            assert [e[:2] for e in log] == [e[:2] for e in reference]
    finally:
        set_delay_hook(None)


class _FakeSingle(Work):
    """A single-phase work (issued at launch) whose handle finishes at a moment the test picks: ``ready`` may turn
    true before its ``wait()`` (the engine then completes it while idle) or only at it."""

    def __init__(self, name: str, log: list, early: bool) -> None:
        self.early, self._done = early, False
        log.append((name, 0, threading.current_thread().name))

    def wait(self) -> None:
        self._done = True

    @property
    def ready(self) -> bool:
        return self.early

    @property
    def done(self) -> bool:
        return self._done


def _program_with_early_single(engine: ProgressEngine, log: list, early: bool) -> None:
    """A multi-hop reduction, then a gather whose wait comes before the next launch (ZeRO-3's backward)."""
    red = engine.submit(lambda: _FakeWork("reduce", 3, log))
    gather = engine.submit(lambda: _FakeSingle("gather", log, early))
    if early:
        while not gather.finished:      # the engine retired it while idle
            time.sleep(0.001)
    gather.wait()
    later = engine.submit(lambda: _FakeWork("next", 2, log))
    red.wait()
    later.wait()


def test_complete_of_an_early_finished_work_still_completes_the_older_ones():
    """The deadlock of ZeRO-3 + ByteGrad with replicas at DP 8: a gather's handle finished before its wait() on
    one rank and not on another, so the older reduction's later hops were issued at different commands."""
    logs = {}
    for early in (False, True):
        logs[early] = []
        _program_with_early_single(ProgressEngine(), logs[early], early)
    assert [e[:2] for e in logs[True]] == [e[:2] for e in logs[False]]
    assert [e[:2] for e in logs[False]].index(("reduce", 2)) < [e[:2] for e in logs[False]].index(("next", 0))


def test_complete_advances_the_newer_works_in_rounds_while_the_target_has_hops_left():
    """COMPLETE(a) advances b one hop per round while a still has hops, so a hop of b travels while the engine
    waits for a's; the round that finishes a leaves b alone (the waiting thread is not held for b). The inline
    engine (one in-order CUDA stream, where a hop of b between a's would only delay a's done event) finishes a
    alone."""
    rounds = [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1), ("a", 3), ("b", 2)]
    alone = [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("a", 3)]
    for inline, expected in ((False, rounds), (True, alone)):
        log: list = []
        eng = ProgressEngine(inline=inline)
        a = eng.submit(lambda: _FakeWork("a", 4, log))
        b = eng.submit(lambda: _FakeWork("b", 4, log))   # its launch advances a: a1
        a.wait()
        eng.quiesce()
        assert [e[:2] for e in log] == expected, inline
        b.wait()
        assert [e[:2] for e in log][-1] == ("b", 3) and len(log) == 8


def test_done_only_after_wait_and_advance_is_a_noop():
    eng = ProgressEngine()
    w = eng.submit(lambda: _FakeWork("a", 2, []))
    eng.quiesce()
    assert not w.done and not w.multi_phase    # branching on done stays at the same program point everywhere
    w.advance()
    w.wait()
    assert w.done and w.finished


def test_inline_engine_issues_the_thread_engines_sequence_on_the_calling_thread():
    """CUDA's inline engine runs the same rule (less COMPLETE's advances of newer works: ``advance_newer=False`` on
    a thread engine is its reference): the same collective sequence, all of it on the submitting thread, each
    command done when submit()/wait() returns (nothing left for a thread to do)."""
    reference: list = []
    _program(ProgressEngine(advance_newer=False), reference)
    for early in (False, True):
        ref_early: list = []
        _program_with_early_single(ProgressEngine(advance_newer=False), ref_early, early)
        log: list = []
        _program_with_early_single(ProgressEngine(inline=True), log, early)
        assert [e[:2] for e in log] == [e[:2] for e in ref_early]
    log = []
    eng = ProgressEngine(inline=True)
    _program(eng, log)
    assert [e[:2] for e in log] == [e[:2] for e in reference]
    assert {t for _, _, t in log} == {threading.current_thread().name}
    assert eng.commands == 8 + 8   # 8 launches, 8 first waits (one of them the pool's): every one already run
    nested: list = []
    outer = eng.submit(lambda: eng.submit(lambda: _FakeWork("inner", 2, nested)))   # a chained stage submits again
    assert type(outer).__name__ == "EngineWork" and nested == [("inner", 0, threading.current_thread().name)]
    outer.wait()
    assert [e[:2] for e in nested] == [("inner", 0), ("inner", 1)]


def test_inline_engine_serialises_threads_and_refuses_a_wait_inside_a_command():
    """Two threads submitting (the autograd thread and the training thread): a command runs whole before the other
    thread's; and a wait() issued inside a command is a programming error that fails the engine, not a reorder."""
    eng = ProgressEngine(inline=True)
    log: list = []
    inside, release = threading.Event(), threading.Event()

    def slow_launch():
        assert eng.on_engine_thread()
        inside.set()
        release.wait(5)
        return _FakeWork("slow", 1, log)

    first = threading.Thread(target=lambda: eng.submit(slow_launch).wait())
    first.start()
    assert inside.wait(5)
    assert not eng.on_engine_thread()           # another thread's command is running, not ours
    second = threading.Thread(target=lambda: eng.submit(lambda: _FakeWork("next", 1, log)).wait())
    second.start()
    second.join(0.2)
    assert second.is_alive() and log == []      # the lock holds it until the first command is done
    release.set()
    first.join(5)
    second.join(5)
    assert [e[:2] for e in log] == [("slow", 0), ("next", 0)]

    older = eng.submit(lambda: _FakeWork("older", 2, log))
    bad = eng.submit(lambda: (older.wait(), _FakeWork("bad", 1, log))[1])
    with pytest.raises(ProgressEngineError, match="inside an engine command"):
        bad.wait()
    with pytest.raises(ProgressEngineError):
        older.wait()


def test_runs_inline_only_where_wait_does_not_block_the_host(monkeypatch):
    from megatron_ext.comm.progress import runs_inline

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT", raising=False)
    assert runs_inline(cuda, "nccl") and runs_inline(cuda, "cpu:gloo,cuda:nccl")
    assert not runs_inline(cpu, "gloo") and not runs_inline(cuda, "gloo") and not runs_inline(cpu, "nccl")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    assert not runs_inline(cuda, "nccl")


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_failure_surfaces_at_wait_and_later_works_fail_too(inline):
    eng = ProgressEngine(inline=inline)
    log: list = []
    ok = eng.submit(lambda: _FakeWork("ok", 1, log))
    bad = eng.submit(lambda: _FakeWork("bad", 3, log, fail_at=1))
    later = eng.submit(lambda: _FakeWork("later", 2, log))
    ok.wait()
    with pytest.raises(ProgressEngineError) as e:
        bad.wait()
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(ProgressEngineError):
        later.wait()
    after = eng.submit(lambda: _FakeWork("after", 1, log))
    with pytest.raises(ProgressEngineError):
        after.wait()
    assert ("after", 0) not in [e[:2] for e in log], "a broken engine issued more"


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_a_work_finished_by_a_failing_command_still_succeeds(inline):
    """LAUNCH(c) advances a (its last hop: a finishes) and then b, which fails: a's result stands, b and c fail."""
    eng = ProgressEngine(inline=inline)
    log: list = []
    a = eng.submit(lambda: _FakeWork("a", 2, log))
    b = eng.submit(lambda: _FakeWork("b", 3, log, fail_at=1))
    c = eng.submit(lambda: _FakeWork("c", 1, log))
    a.wait()
    for w in (b, c):
        with pytest.raises(ProgressEngineError):
            w.wait()


class _SlowHandle(Work):
    """A single-phase work whose handle finishes ``after`` seconds from launch."""

    def __init__(self, after: float) -> None:
        self.t_ready = time.monotonic() + after
        self._done = False

    def wait(self) -> None:
        self._done = True

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self.t_ready

    @property
    def done(self) -> bool:
        return self._done


def test_close_lets_handles_in_flight_finish_then_fails_their_waits(monkeypatch):
    import megatron_ext.comm.progress as progress

    eng = ProgressEngine()
    works = [eng.submit(lambda: _SlowHandle(0.3)), eng.submit(lambda: _SlowHandle(60.0))]
    eng.quiesce()
    monkeypatch.setattr(progress, "STOP_WAIT_S", 0.5)
    t0 = time.monotonic()
    eng.close()
    # the first finished during close, the second was dropped at the deadline
    assert 0.45 <= time.monotonic() - t0 < 5.0 and not eng._thread.is_alive()
    assert works[0].finished
    with pytest.raises(ProgressEngineError, match="closed"):
        works[1].wait()


_EXIT_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import megatron_ext as mx
from megatron.core.optimizer import OptimizerConfig


def train(rank, store):
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ddp = mx.OverlappedDDP(m, mx.OverlapConfig(bucket_size=5000, ranks_per_node=1))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3), ddp)
    for _ in range(3):
        ddp(torch.randn(4, 64)).sum().backward(); ddp.finish_grad_sync(); opt.step(); opt.zero_grad()
    assert ddp.engine is not None and ddp.param_sync.pending > 0
    # no destroy_process_group: the last step's gathers are in flight when the interpreter exits
    return m, ddp, opt


# The imports above run once; each rank of each run is a fork of this process that trains and then leaves as a
# script does, through the interpreter's own finalisation (SystemExit at the top level: atexit hooks, then thread
# and module teardown), which is where gloo's thread aborted.
root, runs = sys.argv[1], int(sys.argv[2])
for run in range(runs):
    children = {}
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.path.join(root, f"run{run}_rank{rank}.log"), os.O_WRONLY | os.O_CREAT), 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.environ["RANK"] = str(rank)
            kept = train(rank, "file://" + os.path.join(root, f"store{run}"))   # alive at exit, as a script's globals
            sys.exit(0)
        children[pid] = rank
    deadline = time.monotonic() + 300
    while children and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
        elif pid in children:
            print(f"EXIT {run} {children.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)
    for pid, rank in children.items():   # a hang: reported as such, killed and reaped
        print(f"EXIT {run} {rank} hung", flush=True)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
"""


def test_exit_lets_training_thread_gathers_finish_within_the_deadline(monkeypatch):
    """The exit hook waits for the in-flight works of every registered owner (the weight gathers run on the
    training thread, not on an engine) until each is ready, and gives up on one that never is at the deadline."""
    import weakref

    from megatron_ext.comm import progress

    class Slow(Work):   # ready after `polls` looks
        def __init__(self, polls: int) -> None:
            self.left = polls

        @property
        def ready(self) -> bool:
            self.left -= 1
            return self.left < 0

        def wait(self) -> None:
            raise AssertionError("the exit hook polls; it never blocks in wait()")

        @property
        def done(self) -> bool:
            return False

    class Owner:
        def __init__(self, works) -> None:
            self.works = works

        def in_flight(self):
            return self.works

    monkeypatch.setattr(progress, "POLL_S", 0.0)
    monkeypatch.setattr(progress, "STOP_WAIT_S", 0.2)
    monkeypatch.setattr(progress, "close_all", lambda: None)   # this test process's engines stay up
    monkeypatch.setattr(progress, "_DRAINED", weakref.WeakSet())  # and its other owners are not looked at
    finishing = Owner([Slow(3), Slow(5)])
    progress.drain_at_exit(finishing)
    progress._at_exit()
    assert [w.left for w in finishing.works] == [-1, -1]      # each looked at until it was ready
    stuck = Owner([Slow(10 ** 9)])        # one deadline for all owners: a peer that is gone costs STOP_WAIT_S
    progress.drain_at_exit(stuck)
    progress._at_exit()
    assert stuck.works[0].left > 0                           # the deadline ended the wait
    del finishing, stuck


def test_process_exits_cleanly_with_gathers_in_flight(tmp_path):
    """2 nodes of 1 rank, the last step's gathers in flight at exit: with the gathers on the engine and no exit hook,
    about a third of these runs aborted in gloo's thread (a gloo work finishing during finalisation). The gathers now
    run on the training thread, the engines are closed at exit and the gathers get the engines' deadline to finish
    (``drain_at_exit``); the process must exit cleanly. Three runs, each rank a forked process that exits through the
    interpreter's finalisation (the script's note: the imports are paid once, not six times)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "exit_with_gathers.py"
    script.write_text(_EXIT_SCRIPT)
    root = str(Path(__file__).resolve().parents[3])   # the checkout, also when the package is not installed
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_EXT_PROGRESS_ENGINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    # its own session, so that on a timeout the forked ranks go with it
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "3"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=3 * 300 + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    exits = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("EXIT ")]
    assert proc.returncode == 0 and len(exits) == 6, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    for run, rank, code in exits:
        err = (tmp_path / f"run{run}_rank{rank}.log").read_text()
        assert code == "0" and "terminate called" not in err, (run, rank, code, err[-3000:])


class _RecordingStreams(StreamOps):
    """The CUDA seam with the stream calls recorded (runs on a CPU-only machine)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def at_submit(self, tensors):
        self.log.append(("submit", len(tensors)))
        return "ready"

    def before_launch(self, token) -> None:
        self.log.append(("comm stream waits", token))

    def at_done(self):
        self.log.append(("done event",))
        return "done"

    def at_consume(self, token) -> None:
        self.log.append(("compute stream waits", token))


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_stream_order_launch_after_ready_event_consumer_waits_on_done_event(inline):
    log: list = []
    eng = ProgressEngine(streams=_RecordingStreams(log), inline=inline)
    t = torch.zeros(4)
    w = eng.submit(lambda: _FakeWork("a", 2, log), (t, t))
    w.wait()
    kinds = [e[0] for e in log]
    assert kinds == ["submit", "comm stream waits", "a", "a", "done event", "compute stream waits"], log
    assert log[1] == ("comm stream waits", "ready") and log[-1] == ("compute stream waits", "done")


# -- the ODO at DP=4 ------------------------------------------------------------------------------------------------
DP, RPN, STEPS = 4, 2, 50
# (grad_reduce, param_gather, plan, qgz stages: None is the auto rule, one stage with this many buckets)
CASES = [("qgz", "qwz", "zero2", 2), ("qgz", "qwz", "zero2", None), ("bytegrad", "plain", "zero2", 2),
         ("qgz", "plain", "mics", 2), ("plain", "plain", "zero2", 2)]
# the inline engine (CUDA's) on gloo: multi-hop with one and two stages, and a replicated plan (chained works); the
# DP 8 ZeRO-3 case below adds chained multi-hop works with backward gathers
INLINE_CASES = [("qgz", "qwz", "zero2", None), ("bytegrad", "plain", "zero2", 2), ("qgz", "plain", "mics", 2),
                ("bytegrad", "qwz", "zero3x2", 2)]


def test_auto_qgz_stages_one_stage_with_many_buckets_and_the_engine():
    import megatron_ext as mx

    auto = mx.OverlapConfig(qgz_pipeline_stages=None)
    assert auto.resolved_qgz_stages(14, engine=True) == 1
    assert auto.resolved_qgz_stages(2, engine=True) == 2
    assert auto.resolved_qgz_stages(14, engine=False) == 2
    assert mx.OverlapConfig().resolved_qgz_stages(14, engine=True) == 2   # the default stays explicit


def _train(gr: str, pg: str, plan: str, stages, engine: bool, delays: bool, steps: int = STEPS,
           rpn: int = RPN, inline: bool = False) -> torch.Tensor:
    """``inline``: the engine CUDA uses (the rule run on the submitting thread), here on gloo, where it blocks."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    from megatron_ext.comm import progress

    import megatron_ext as mx

    rank = dist.get_rank()
    torch.manual_seed(0)
    # ZeRO-3: one layer per bucket, so backward gathers and reductions interleave over many buckets.
    widths = [32] * 7 + [5] if plan == "zero3x2" else [13, 37, 29, 5]
    layers = [m for a, b in zip(widths[:-1], widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())]
    module = torch.nn.Sequential(*layers[:-1])
    plans = {"zero2": mx.ShardingPlan(), "mics": mx.ShardingPlan.mics(rpn),
             "zero3x2": mx.ShardingPlan.zero3(dist.get_world_size() // 2)}   # ZeRO-3, 2 replicas: chained works
    sharding = plans[plan]
    cfg = mx.OverlapConfig(bucket_size=1100 if plan == "zero3x2" else 200, buffer_pool_size=2, grad_reduce=gr, param_gather=pg, ranks_per_node=rpn,
                           quant_group_size=32, sharding=sharding, progress_engine=engine,
                           qgz_pipeline_stages=stages)
    original, progress.runs_inline = progress.runs_inline, lambda device, backend: inline
    try:
        model = mx.OverlappedDDP(module, cfg)
    finally:
        progress.runs_inline = original
    assert (model.engine is not None) == engine and (not engine or model.engine.inline == inline)
    if stages is None and engine:
        assert model.qgz_stages == 1 and len(model.buckets) >= 4
    opt = mx.OverlappedDistributedOptimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0), model)
    rng = random.Random(1000 * rank + 7)
    if delays:
        set_delay_hook(lambda where: time.sleep(rng.random() * 0.003) if rng.random() < 0.3 else None)
    try:
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(steps):
            x, y = torch.randn(8, widths[0], generator=g), torch.randn(8, 5, generator=g)
            if step % 5 == 4:   # some steps with two micro-batches (accumulation inside no_sync)
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
                torch.nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
            model.finish_grad_sync()
            opt.step()
            opt.zero_grad()
        model.start_param_sync(force_sync=True)
        model.force_param_sync()   # ZeRO-3: the weights are released after the step
    finally:
        set_delay_hook(None)
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _all_variants(cases=CASES, steps: int = STEPS, rpn: int = RPN, inline: bool = True):
    """Per case: the synchronous path, the engine under random delays and (``inline``) CUDA's inline engine, here on
    gloo. (The engine without delays ran here too until the suite's time budget: one timing among those the delays
    produce, and run undelayed by the backends' tests with the engine on.)"""
    W.capture_logs()
    out = {}
    for gr, pg, plan, stages in cases:
        key = f"{gr}+{pg}/{plan}/stages={stages}"
        # auto stages: one stage with the engine and this many buckets (asserted in _train), so sync runs one
        out[key] = {"sync": _train(gr, pg, plan, 1 if stages is None else stages, False, False, steps, rpn),
                    "delayed": _train(gr, pg, plan, stages, True, True, steps, rpn)}
        if inline and (gr, pg, plan, stages) in INLINE_CASES:
            out[key]["inline"] = _train(gr, pg, plan, stages, True, False, steps, rpn, inline=True)
    return out


def test_random_engine_delays_give_the_same_weights_and_never_hang():
    res = run_distributed(_all_variants, DP, timeout=600)
    assert sum("inline" in v for v in res[0].values()) == len([c for c in CASES if c in INLINE_CASES]) == 3
    _check_same_weights(res)


def test_dp8_engine_and_delays_match_the_synchronous_path():
    """2 nodes x 4 ranks: the engine under random delays gives the synchronous path's weights (the
    inline engine runs these backends at DP 4 above; skipped here for the suite's time), and the ring's 7 hops a
    bucket."""
    cases = [("qgz", "qwz", "zero2", 2), ("bytegrad", "plain", "zero2", 2), ("qgz", "plain", "mics", 2),
             ("ring", "plain", "zero2", 2)]
    _check_same_weights(run_distributed(_all_variants, 8, cases, 10, 4, inline=False, timeout=600))


def test_dp8_zero3_with_replicas_over_four_nodes():
    """4 nodes x 2 ranks, ZeRO-3 over 2 nodes replicated twice with ByteGrad + qwZ: backward gathers wait between
    chained multi-hop reductions (this deadlocked when an early-finished gather skipped completing older works)."""
    res = run_distributed(_all_variants, 8, [("bytegrad", "qwz", "zero3x2", 2)], 10, 2, timeout=600)
    assert all("inline" in v for v in res[0].values())
    _check_same_weights(res)


def _check_same_weights(res) -> None:
    for key in res[0]:
        ref = res[0][key]["sync"]
        for rank, out in enumerate(res):
            assert set(out[key]) >= {"sync", "delayed"}
            for variant, weights in out[key].items():
                assert torch.equal(weights, ref), (key, rank, variant)
