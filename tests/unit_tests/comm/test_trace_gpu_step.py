"""tools/trace_gpu_step.py (issue 14's GPU check) without a GPU: the trace and wait summaries on hand-made events,
the emulated link's data on a fake process group, a tiny CPU run of every configuration, and its argument errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..tool_loader import TOOLS, loaded_tool

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tool():
    with loaded_tool("trace_gpu_step") as mod:
        yield mod


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def _step(t0: float, corr: int) -> list:
    """One step at ``t0`` (us): forward [0, 10), backward [10, 40), finish [40, 42), step [42, 50). Compute stream 7
    runs backward kernels over [12, 20) and [24, 34); stream 13 (communication) runs [18, 28) and [36, 44)."""
    ev = [_x("user_annotation", "mx.forward", t0, 10), _x("user_annotation", "mx.backward", t0 + 10, 30),
          _x("user_annotation", "mx.finish", t0 + 40, 2), _x("user_annotation", "mx.step", t0 + 42, 8)]
    launches = [(t0 + 1, 7, t0 + 2, 6), (t0 + 11, 7, t0 + 12, 8), (t0 + 12, 13, t0 + 18, 10),
                (t0 + 15, 7, t0 + 24, 10), (t0 + 30, 13, t0 + 36, 8), (t0 + 43, 7, t0 + 44, 4)]
    for i, (launch_ts, stream, ts, dur) in enumerate(launches):
        c = corr + i
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", launch_ts, 1, tid=2 if stream == 13 else 1, correlation=c))
        ev.append(_x("kernel", f"k{c}", ts, dur, tid=stream, stream=stream, correlation=c))
    ev.append(_x("cuda_runtime", "cudaEventQuery", t0 + 20, 1, tid=2, correlation=corr + 50))       # not blocking
    ev.append(_x("cuda_runtime", "cudaStreamSynchronize", t0 + 45, 1, correlation=corr + 51))        # in the step
    if t0 == 0:
        ev.append(_x("cuda_runtime", "cudaMalloc", t0 + 21, 700, tid=3, correlation=corr + 52))   # 0.7 ms, backward
    return ev


def test_trace_summary_per_step(tool):
    events = _step(0.0, 100) + _step(1000.0, 200)
    s = tool.summarize_trace(events)
    assert s["compute_stream"] == 7
    # backward window: compute ops launched in backward span [12, 34); compute busy 8 + 10; communication clipped to
    # the window: [18, 28) and [34, 34) -> 10; overlap of [12,20)+[24,34) with [18,28): 2 + 4.
    assert s["backward_per_step"] == {"backward_gpu_ms": 0.022, "compute_busy_ms": 0.018, "comm_busy_ms": 0.01,
                                      "overlap_ms": 0.006}
    assert s["host_ms_per_step"] == {"forward": 0.01, "backward": 0.03, "finish": 0.002, "step": 0.008}
    assert s["host_syncs_per_step"]["backward"] == {}
    assert s["host_syncs_per_step"]["step"] == {"cudaStreamSynchronize": 1.0}
    assert s["long_cuda_calls_per_step"]["backward"] == {"cudaMalloc": 0.5}   # one in two steps


def test_wait_summary_counts_stalls_per_phase_and_source(tool):
    stalls = [("backward", "pool_acquire", 0.5), ("backward", "pool_acquire", 0.001), ("finish", "engine_wait", 2.0),
              ("forward", "collective_wait", 0.0)] * 2
    w = tool.summarize_waits(stalls, steps=2)
    assert w["backward"] == {"waits_per_step": 2.0, "stalled_per_step": 1.0, "stall_ms_per_step": 0.501,
                             "max_stall_ms": 0.5, "by_source": {"pool_acquire": 4}}
    assert w["finish"]["stalled_per_step"] == 1.0 and w["forward"]["stalled_per_step"] == 0.0
    assert w["step"]["waits_per_step"] == 0.0


def test_check_refuses_waits_in_backward_other_than_the_pool(tool):
    def row(by_source, syncs=None):
        waits = {ph: {"by_source": {}} for ph in tool.PHASES}
        waits["backward"] = {"by_source": by_source}
        return {"combo": "qgZ", "engine": "inline", "buffer_pool_size": 2, "compute_stream_waits": waits,
                "host_syncs_per_step": {"backward": syncs or {}}}

    assert tool.violations([row({"pool_acquire": 31}), {"combo": "no-comm", "step_ms": 1.0}]) == []
    assert "engine_wait" in tool.violations([row({"pool_acquire": 3, "engine_wait": 1})])[0]
    assert "cudaStreamSynchronize" in tool.violations([row({}, {"cudaStreamSynchronize": 1.0})])[0]
    assert "boom" in tool.violations([{"combo": "x", "error": "boom"}])[0]


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TOOLS)]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_emulated_link_writes_what_ranks_holding_the_same_data_receive():
    out = _run_python("""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import trace_gpu_step as t
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        link = t.EmulatedLink(2, 1.0, 0.0, 0.0)
        link.install()
        x = torch.arange(8.0)
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, x)                      # rank 0's chunk, summed over 4 equal ranks
        assert out.tolist() == [0.0, 4.0], out
        g = torch.zeros(8)
        dist.all_gather_into_tensor(g, torch.tensor([1.0, 2.0]))
        assert g.tolist() == [1.0, 2.0] * 4, g
        a = torch.zeros(8)
        dist.all_to_all_single(a, x)
        assert torch.equal(a, x)
        n = torch.tensor([3], dtype=torch.int64)
        dist.all_reduce(n)                                      # integer flags stay integers
        assert n.dtype == torch.int64 and n.item() == 12
        m = torch.tensor([5.0])
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        assert m.item() == 5.0
        w = dist.all_reduce(torch.ones(4), async_op=True)
        assert w.is_completed() and w.wait() and w.get_future().done()
        # ring bytes per rank: 3/4 of 32 B for each of the first three, 2 x 3/4 of 8, 4 and 16 B for the all-reduces
        assert link.calls == 6 and link.wire_bytes == 24 + 24 + 24 + 12 + 6 + 24, link.wire_bytes
        print("ok")
        """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_cpu_run_of_every_configuration(tmp_path):
    """The plumbing on CPU (no timing asserted): every combination and engine trains without a skipped step with an
    explicit pool size, the emulated link carrying its collectives (synchronous on CPU, so the inline engine runs
    here too)."""
    path = tmp_path / "trace.json"
    out = _run_python(f"""
        import trace_gpu_step as t
        t.main(["--device", "cpu", "--width", "32", "--hidden", "64", "--depth", "2", "--rows", "8",
                "--bucket-numel", "3000", "--world-size", "8", "--ranks-per-node", "4", "--warmup", "1",
                "--steps", "1", "--pool-sizes", "4", "--engines", "inline,thread", "--host-buckets", "4",
                "--json", {str(path)!r}])
        """)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    assert rows[0]["combo"].startswith("no-comm")
    odo = rows[1:]
    assert len(odo) == 3 * 2 and not [r for r in odo if "error" in r], odo
    assert all(r["skipped_steps"] == 0 and r["buckets"] >= 3 and r["buffer_pool_size"] == 4 for r in odo)
    # the per-bucket host time of reductions (engine and backend alone) and gathers, apart from the steps
    assert all(sorted(r["host_us_per_bucket"]) == ["gather", "reduce_backend", "reduce_engine"]
               and min(r["host_us_per_bucket"].values()) > 0 for r in odo), odo
    assert sorted((r["combo"], r["engine"]) for r in odo) == sorted(
        (c, e) for c in ("plain", "qwZ+qgZ INT4", "ByteGrad") for e in ("inline", "thread"))
    assert json.loads(path.read_text())["meta"]["link_calls"] > 0


@pytest.mark.parametrize("argv,flag", [(["--engines", "inline,fast"], "--engines"),
                                       (["--world-size", "12", "--ranks-per-node", "8"], "--world-size"),
                                       (["--host-buckets", "-1"], "--host-buckets")])
def test_bad_arguments_name_the_flag(tool, capsys, argv, flag):
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu"] + argv)
    assert flag in capsys.readouterr().err
