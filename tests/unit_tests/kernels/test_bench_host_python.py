"""tools/bench_host_python.py with a few calls: every per-bucket call runs through the ops' Python with the Triton
launchers stubbed (no GPU, no Triton compile), and the launchers are restored afterwards."""
import json

import pytest

from ..tool_loader import loaded_tool

pytest.importorskip("triton")


def test_every_case_runs_stubbed_and_the_launchers_come_back(tmp_path):
    from megatron_ext.kernels import triton_ops
    from megatron_ext.kernels.triton_launch import FastLauncher

    before = {n: getattr(triton_ops, n) for n in dir(triton_ops) if isinstance(getattr(triton_ops, n), FastLauncher)}
    assert before
    out = tmp_path / "host.json"
    with loaded_tool("bench_host_python") as tool:
        with tool.stubbed_launchers(triton_ops) as n:
            assert n == len(before)
            assert not any(isinstance(getattr(triton_ops, k), FastLauncher) for k in before)
        tool.main(["--numel", "65536", "--calls", "2", "--repeat", "1", "--json", str(out)])
    assert all(getattr(triton_ops, k) is v for k, v in before.items())
    got = json.loads(out.read_text())
    assert len(got["us_per_call"]) == 8 and all(v > 0 for v in got["us_per_call"].values())
    assert got["x_empty"]["torch.empty (the unit)"] == 1.0
