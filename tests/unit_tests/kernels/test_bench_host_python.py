"""tools/bench_host_python.py with a few calls: every per-bucket call runs through the ops' Python with the Triton
launchers stubbed (no GPU, no Triton compile) and launches what the op launches on a GPU; the launchers are restored
afterwards."""
import json

import pytest

from ..tool_loader import loaded_tool

pytest.importorskip("triton")

# Triton launches per call, from the ops' code: the min-max quantize is three kernels (partial min/max, finish, codes),
# the qwZ hop a quantize and a row decode, every other op one kernel (qgZ's last step too: the averaging is in it; and
# ByteGrad's decode of all N gathered rows), whatever the number of nodes.
LAUNCHES = [0, 2, 1, 1, 1, 1, 1, 3, 1, 1]


def test_every_case_runs_stubbed_and_the_launchers_come_back(tmp_path):
    from megatron_ext.kernels import triton_ops
    from megatron_ext.kernels.triton_launch import FastLauncher

    before = {n: getattr(triton_ops, n) for n in dir(triton_ops) if isinstance(getattr(triton_ops, n), FastLauncher)}
    assert before
    out = tmp_path / "host.json"
    with loaded_tool("bench_host_python") as tool:
        with tool.stubbed_launchers(triton_ops) as launches:
            assert not any(isinstance(getattr(triton_ops, k), FastLauncher) for k in before)
            assert not launches
        tool.main(["--numel", "65536", "--calls", "2", "--repeat", "1", "--json", str(out)])
    assert all(getattr(triton_ops, k) is v for k, v in before.items())
    got = json.loads(out.read_text())
    assert list(got["launches_per_call"].values()) == LAUNCHES
    assert len(got["us_per_call"]) == len(LAUNCHES) and all(v > 0 for v in got["us_per_call"].values())
    assert got["x_empty"]["torch.empty (the unit)"] == 1.0
    with loaded_tool("bench_host_python") as tool:   # four nodes: still one launch per op
        tool.main(["--numel", "65536", "--nodes", "4", "--ranks-per-node", "2", "--calls", "2", "--repeat", "1",
                   "--json", str(out)])
    assert list(json.loads(out.read_text())["launches_per_call"].values()) == LAUNCHES
