"""tools/bench_kernels.py at tiny sizes: default sweep, memory plan, goal marks, table and JSON (never big sizes)."""
import importlib.util
import json
import sys

import pytest
import torch

from ..tool_loader import TOOLS, loaded_tool

_BENCH = TOOLS / "bench_kernels.py"
GIB = 1 << 30


@pytest.fixture(scope="module")
def bench():
    with loaded_tool("bench_kernels") as mod:
        yield mod


def test_default_sweep_is_1M_to_256M_and_fits_a_24GiB_machine(bench):
    sizes = [bench.parse_size(s) for s in bench.DEFAULT_SIZES.split(",")]
    assert sizes[0] == 1 << 20 and sizes[-1] == 256 << 20
    # 256M fp32 with the default geometry: 4 GiB of input, 17.5 bytes per element + 256 MiB in all
    need = bench.estimate_peak_bytes(256 << 20, torch.float32, 2048, 2, 4)
    assert need == int(17.5 * (256 << 20)) + (256 << 20)
    run, skipped = bench.sizes_that_fit(sizes, torch.float32, 22 * GIB, 2048, 2, 4)  # 24 GiB, ~22 available
    assert run == sizes and skipped == []
    run, skipped = bench.sizes_that_fit(sizes, torch.float32, 2 * GIB, 2048, 2, 4)  # a small machine skips, loudly
    assert run == sizes[:-1] and [s["numel"] for s in skipped] == [256 << 20]
    assert skipped[0]["estimated_peak_bytes"] == need and skipped[0]["available_bytes"] == 2 * GIB


def test_reduce_ops_take_sizes_below_k_groups(bench):
    """numel < k * group used to fail in x[:per * k].view(k, -1): the chunks are now the zero-padded input."""
    assert bench.chunk_numel(1000, 4, 2048) == 2048 and bench.chunk_numel(8 << 20, 4, 2048) == 2 << 20
    ops = bench.build_ops(1000, torch.float32, "cpu", group=2048, nodes=2, rpn=4, stages=2, chunk=512)
    assert len(ops) == 10
    for name, fn, nbytes in ops:
        assert nbytes > 0, name
        fn()


@pytest.mark.parametrize("device,backend,ratio,mark", [
    ("cpu", "torch", 0.31, "meets >= 30%"), ("cpu", "torch", 0.29, "MISSES >= 30%"),
    ("cpu", "compiled", 0.50, "meets >= 50%"), ("cpu", "compiled", 0.49, "MISSES >= 50%"),
    ("cuda", "triton", 0.80, "meets >= 80%"), ("cuda", "triton", 0.79, "MISSES >= 80%"),
    ("cpu", "triton", 0.9, "n/a")])
def test_table_marks_the_issue_goals(bench, device, backend, ratio, mark):
    row = bench.Row("quantize_int8", device, backend, 1 << 20, 100, 1e-3, ratio, 1.0, ratio, 1.0, ratio,
                    *bench.judge(device, backend, ratio))
    lines = bench.format_table([row])
    assert "torch on CPU >= 30%" in lines[0] and "compiled on CPU >= 50%" in lines[0]
    assert "triton on CUDA >= 80%" in lines[0]
    assert f"| {100 * ratio:.0f}% | {mark} |" in lines[-1]


def test_smoke_run_writes_table_and_json(bench, tmp_path, capsys, monkeypatch):
    """CPU: an eager torch row and a compiled row per op (compiled at this tiny size too), checked against torch."""
    monkeypatch.delenv("MX_KERNELS", raising=False)
    out = tmp_path / "bench.json"
    bench.main(["--sizes", "4K", "--repeat", "1", "--devices", "cpu", "--out", str(out)])
    text = capsys.readouterr().out
    assert "Goals (issues 3 and 14)" in text and "| quantize_int8 | cpu | torch | 4K |" in text
    assert "| quantize_int8 | cpu | compiled | 4K |" in text
    data = json.loads(out.read_text())
    assert data["meta"]["goals"] == {"cpu/torch": 0.3, "cpu/compiled": 0.5, "cuda/triton": 0.8}
    assert data["skipped"] == []
    assert [r["backend"] for r in data["rows"]] == ["torch", "compiled"] * 10
    for r in data["rows"]:
        assert r["numel"] == 4096 and r["gbps"] > 0 and r["copy_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["copy_gbps"])
        goal = 0.3 if r["backend"] == "torch" else 0.5
        assert r["goal"] == goal and r["meets_goal"] == (r["ratio"] >= goal)
        if r["backend"] == "torch":  # the reference
            assert r["matches_torch"] is None and r["first_call_seconds"] is None
        else:
            assert r["matches_torch"] is True and r["first_call_seconds"] > 0
        assert r["host_us_per_call"] is None   # measured on GPUs only (on CPU a call's host time is the op's time)


def test_host_time_per_call_runs_the_calls_back_to_back_between_syncs(bench):
    """``calls`` calls per round with no sync among them, a sync before each round and at the end; the result is a
    per-call mean in microseconds (the smallest round's)."""
    log = []
    us = bench.host_us_per_call(lambda: log.append("call"), lambda: log.append("sync"), calls=4, rounds=3)
    assert log == (["sync"] + ["call"] * 4) * 3 + ["sync"]
    assert 0 < us < 1e6


def test_same_outputs_compares_every_bit(bench):
    a = (torch.tensor([1.0, -0.0, 3.0]), torch.tensor([7], dtype=torch.uint8))
    assert bench.same_outputs(a, tuple(t.clone() for t in a))
    assert not bench.same_outputs(a, (torch.tensor([1.0, 0.0, 3.0]), a[1]))  # -0.0 vs +0.0: values equal, bits not
    assert not bench.same_outputs(a[0], torch.tensor([1.0, -0.0, 3.0000002]))  # one ulp
    assert not bench.same_outputs(a[0], a[0].to(torch.float64))
    assert not bench.same_outputs(a, a[:1])
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert bench.same_outputs(bf, bf.clone()) and not bench.same_outputs(bf, bf.float())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_rows_check_their_output_against_torch(tmp_path):
    """A forced Triton run (interpreted on CPU here, compiled on a GPU) checks every op against the torch path
    before timing it and reports the outcome per row."""
    import os
    import subprocess
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", MX_KERNELS="triton")
    proc = subprocess.run([sys.executable, str(_BENCH), "--sizes", "4K", "--repeat", "1", "--devices", "cpu",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10 and all(r["backend"] == "triton" and r["matches_torch"] is True for r in rows), rows
    assert proc.stdout.count("| yes |") == 10 and "NO |" not in proc.stdout
