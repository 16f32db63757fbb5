"""tools/bench_optimizer.py: argument checks and a tiny CPU run (never timed: timings are not asserted)."""
import json

import pytest
import torch

from ..tool_loader import loaded_tool


@pytest.fixture(scope="module")
def bench():
    with loaded_tool("bench_optimizer") as mod:
        yield mod


def test_bad_arguments_name_the_flag(bench, capsys):
    for argv, flag in ((["--world-size", "1"], "--world-size"),
                       (["--odo-accumulate", "shard,lazy"], "--odo-accumulate"),
                       (["--micro-batches", "0"], "--micro-batches")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert flag in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cuda", "--world-size", "1"])
        assert "CUDA is not available" in capsys.readouterr().err
    else:
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cuda", "--world-size", "1", "--start-method", "fork"])
        assert "--start-method" in capsys.readouterr().err


def test_megatron_core_peer_only_on_gpus(bench):
    kinds = lambda device: [c.kind for c in bench.configs([1], False, False, device, ("auto",))]  # noqa: E731
    assert "mcore" not in kinds("cpu") and kinds("cuda").count("mcore") == 1
    assert [c.accumulate for c in bench.configs([1], True, False, "cpu", ("local",)) if c.kind == "odo"] == \
        ["local", "local"]  # overlap on and off


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_cpu_run_trains_alike(bench, tmp_path, dtype):
    out = tmp_path / "bench.json"
    rc = bench.main(["--params", "2e4", "--width", "32", "--batch", "4", "--world-size", "2", "--steps", "2",
                     "--warmup", "1", "--micro-batches", "2", "--only", "odo,ddp+zero", "--odo-accumulate", "auto",
                     "--bucket-size", "5000", "--no-prewarm", "--dtype", dtype, "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["model"]["dtype"] == dtype and data["memory_probe"] == "VmHWM (RSS)"
    rows = {r["label"]: r for r in data["rows"]}
    assert set(rows) == {"DDP + ZeroRedundancyOptimizer", "ODO auto overlap=on", "ODO auto overlap=off"}
    if dtype == "fp32":  # same data, same init, same AdamW: the ODO trains like DDP + ZeRO
        ref = rows["DDP + ZeroRedundancyOptimizer"]["final_loss"]
        for label in ("ODO auto overlap=on", "ODO auto overlap=off"):
            assert rows[label]["final_loss"] == pytest.approx(ref, rel=1e-5)
