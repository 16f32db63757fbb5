"""Run a test body in a fresh gloo world of N CPU processes.

[Note: failure and hang handling]
Each rank runs in a spawned process with a FileStore rendezvous (no port races between concurrent tests) and a
collective timeout, so a rank waiting on a peer that died raises instead of hanging. The parent polls the ranks;
the first rank that fails has its traceback re-raised as the test failure and the other ranks are killed. A world
that has not finished within ``timeout`` seconds is killed and reported with the ranks still running.

[Note: rendezvous retries]
Gloo's full-mesh connect on a loaded host now and then drops a socket ("Connection closed by peer" inside
``init_process_group``), which says nothing about the code under test; torch's own suite retries the same messages
(``retry_on_connect_failures``). Each rank therefore joins the world and passes a barrier before it runs the test
body, so no rank has started the body when a peer's connect fails; such a world is killed and started again in a
fresh store, up to ``SETUP_ATTEMPTS`` times. Any other set-up error, and every error inside the body, fails at once.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = float(os.environ.get("MX_TEST_COLLECTIVE_TIMEOUT", "60"))
SETUP_ATTEMPTS = 3
_CONNECT_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Connection refused",
                     "Connect timeout", "Address already in use")


class DistributedTestError(AssertionError):
    pass


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, kwargs: dict,
            results: "mp.Queue", env: dict, backend: str) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    try:
        try:
            _injected_join_fault(rank)
            dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            dist.barrier()
        except BaseException:  # noqa: BLE001 - see [Note: rendezvous retries]
            results.put(("setup", rank, traceback.format_exc()))
            return
        out = fn(*args, **kwargs)
        # Plain pickle bytes: torch's multiprocessing reducers would share tensors through file descriptors
        # that die with this process.
        try:
            payload = pickle.dumps(out)
        except Exception:
            payload = pickle.dumps(None)
        results.put(("ok", rank, payload))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put(("err", rank, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _injected_join_fault(rank: int) -> None:
    """The harness's own test: ``MX_TEST_JOIN_FAULT=<path>`` makes rank 0's first join fail as gloo's connect
    does, once (the file records that it fired)."""
    path = os.environ.get("MX_TEST_JOIN_FAULT")
    if rank == 0 and path and not os.path.exists(path):
        open(path, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer (injected)")


_CTX = None


def _context():
    """A forkserver that has already imported torch and megatron-core: each world is a set of fresh processes
    forked from it, so a test pays the (multi-second) imports once per session instead of once per rank."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        preload = ["torch", "torch.distributed", "megatron_ext"]
        try:
            import megatron.core  # noqa: F401
            preload += ["megatron.core", "megatron.core.optimizer", "megatron.core.parallel_state"]
        except Exception:
            pass
        ctx.set_forkserver_preload(preload)
        _CTX = ctx
    return _CTX


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
                    env: dict | None = None, backend: str = "gloo", **kwargs: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results (rank order).

    ``fn`` must be a module-level function (it is pickled into spawned processes). ``backend`` is passed to
    ``init_process_group``: ``"cpu:gloo"`` gives a group that, like NCCL for CPU tensors, refuses other devices.
    """
    child_env = {"LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", "MX_IN_TEST_WORLD": "1"}
    child_env.update(env or {})
    for attempt in range(1, SETUP_ATTEMPTS + 1):
        outputs, failure, connect_failed = _run_world(fn, world_size, args, kwargs, timeout, child_env, backend)
        if not (connect_failed and attempt < SETUP_ATTEMPTS):
            break
    if failure is not None:
        raise DistributedTestError(failure)
    return [outputs[r] for r in range(world_size)]


def _run_world(fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float, child_env: dict,
               backend: str) -> tuple[dict, str | None, bool]:
    """One world: the per-rank outputs, the failure to report (or None), and whether it was a connect failure
    while joining (see [Note: rendezvous retries])."""
    ctx = _context()
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="mx_world_")
    store_path = os.path.join(tmpdir, "store")
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_worker, daemon=True,
                        args=(rank, world_size, store_path, fn, args, kwargs, results, child_env, backend))
        p.start()
        procs.append(p)
    outputs: dict = {}
    deadline = time.monotonic() + timeout
    failure = None
    connect_failed = False
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                failure = f"world of {world_size} timed out after {timeout:.0f}s; ranks still running: {missing}"
                break
            try:
                status, rank, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outputs]
                if dead:
                    # Give a dying rank a moment to flush its traceback to the queue.
                    try:
                        status, rank, payload = results.get(timeout=5.0)
                    except queue.Empty:
                        failure = f"rank(s) {dead} exited (code {[procs[r].exitcode for r in dead]}) without a result"
                        break
                else:
                    continue
            if status == "setup":
                connect_failed = any(m in payload for m in _CONNECT_FAILURES)
                failure = f"rank {rank} could not join the world:\n{payload}"
                break
            if status == "err":
                failure = f"rank {rank} failed:\n{payload}"
                break
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        try:
            for f in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, f))
            os.rmdir(tmpdir)
        except OSError:
            pass
    return outputs, failure, connect_failed
