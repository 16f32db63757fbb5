"""Bad input to the planner (CLI and ``pretrain_gpt --auto-plan``) is an error naming the flag, raised before any
planning: numbers out of range, layouts pretrain_gpt refuses, unreadable bucket sizes, an unwritable ``--json``
and hand-written profile files with a missing or wrong field."""
from __future__ import annotations

import json

import pytest

from megatron_ext.planner import cli, hardware_preset

BASE = ["--model", "llama-7b", "--gpus", "64", "--gpus-per-node", "8", "--micro-batch-size", "1",
        "--global-batch-size", "64", "--hardware", "dgx-a100", "--bucket-sizes", "40000000"]


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""            # nothing planned or printed before the error
    return captured.err.split("error:", 1)[1]


def _with(change):
    argv = list(BASE)
    for flag, value in change.items():
        if flag in argv:
            i = argv.index(flag)
            argv[i:i + 2] = [] if value is None else [flag, value]
        else:
            argv += [flag] if value == "" else [flag, value]
    return argv


@pytest.mark.parametrize("change, names", [
    ({"--gpus": "0"}, ["--gpus must be >= 1, got 0"]),
    ({"--gpus": "-8"}, ["--gpus must be >= 1, got -8"]),
    ({"--micro-batch-size": "0"}, ["--micro-batch-size must be >= 1"]),
    ({"--global-batch-size": "0"}, ["--global-batch-size must be >= 1"]),
    ({"--global-batch-size": "-64"}, ["--global-batch-size must be >= 1"]),
    ({"--tensor-model-parallel-size": "0"}, ["--tensor-model-parallel-size must be >= 1"]),
    ({"--pipeline-model-parallel-size": "0"}, ["--pipeline-model-parallel-size must be >= 1"]),
    ({"--gpus-per-node": "0"}, ["--gpus-per-node must be >= 1"]),
    ({"--ffn-hidden-size": "0"}, ["--ffn-hidden-size must be >= 1"]),
    ({"--kv-channels": "0"}, ["--kv-channels must be >= 1"]),
    ({"--seq-length": "0"}, ["--seq-length must be >= 1"]),
    ({"--group-query-attention": "", "--num-query-groups": "0"}, ["--num-query-groups must be >= 1"]),
    ({"--top": "0"}, ["--top must be >= 1"]),
    ({"--global-batch-size": "96"}, ["--global-batch-size (96) must be a multiple of --micro-batch-size (1) x "
                                     "data-parallel size (64"]),
    ({"--gpu-memory": "0GB"}, ["--gpu-memory must be positive"]),
    ({"--gpu-memory": "1.2.3GB"}, ["--gpu-memory: cannot read"]),
], ids=lambda x: x if isinstance(x, str) else None)
def test_numbers_out_of_range_name_the_flag(capsys, change, names):
    err = _error(capsys, _with(change))
    for n in names:
        assert n in err, err


@pytest.mark.parametrize("change, names", [
    # llama-30b: 52 heads
    ({"--model": "llama-30b", "--tensor-model-parallel-size": "8"},
     ["--num-attention-heads (52) must be divisible by --tensor-model-parallel-size (8)"]),
    ({"--tensor-model-parallel-size": "16"},
     ["--gpus-per-node (8) must be a multiple of --tensor-model-parallel-size (16)"]),
    ({"--pipeline-model-parallel-size": "3", "--gpus": "48", "--global-batch-size": "48"},
     ["--num-layers (32) must be divisible by --pipeline-model-parallel-size (3)"]),
    ({"--gpus": "60", "--tensor-model-parallel-size": "8"},
     ["--gpus (60) is not divisible by --tensor-model-parallel-size (8) x --pipeline-model-parallel-size (1)"]),
    ({"--num-query-groups": "8"}, ["--num-query-groups needs --group-query-attention"]),
    ({"--group-query-attention": "", "--num-query-groups": "5"},
     ["--num-query-groups (5) must be positive and divide --num-attention-heads (32)"]),
    ({"--group-query-attention": "", "--num-query-groups": "4", "--tensor-model-parallel-size": "8"},
     ["--num-query-groups (4) divisible by --tensor-model-parallel-size (8)"]),
    ({"--recompute-granularity": "full"}, ["--recompute-granularity full needs --recompute-method"]),
    ({"--recompute-granularity": "full", "--recompute-method": "block"},
     ["--recompute-granularity full needs --recompute-num-layers"]),
    ({"--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": "33"},
     ["--recompute-num-layers between 1 and the layers per pipeline stage (32), got 33"]),
    ({"--recompute-method": "uniform"}, ["--recompute-method applies to --recompute-granularity full only"]),
    ({"--recompute-granularity": "selective", "--recompute-num-layers": "2"},
     ["--recompute-num-layers applies to --recompute-granularity full only"]),
], ids=["heads-tp", "tp-over-node", "layers-pp", "gpus-tp", "groups-without-gqa", "groups-heads", "groups-tp",
        "full-no-method", "full-no-layers", "full-too-many-layers", "method-without-full", "layers-without-full"])
def test_layouts_pretrain_gpt_refuses_are_refused_naming_its_flags(capsys, change, names):
    err = _error(capsys, _with(change))
    for n in names:
        assert n in err, err


@pytest.mark.parametrize("sizes, names", [
    ("abc", ["--bucket-sizes: cannot read 'abc'"]),
    ("0", ["--bucket-sizes", ">= 1, got '0'"]),
    ("-5", ["--bucket-sizes", ">= 1, got '-5'"]),
    ("1e7,2.5", ["--bucket-sizes", "got '2.5'"]),
    ("", ["--bucket-sizes: cannot read ''"]),
])
def test_bucket_sizes_are_checked_naming_the_flag(capsys, sizes, names):
    err = _error(capsys, _with({"--bucket-sizes": sizes}))
    for n in names + ["--bucket-sizes"]:
        assert n in err, err
    assert "--ddp-bucket-size" not in err


def test_bucket_sizes_accept_exponents():
    assert cli.parse_bucket_sizes("1e7,40000000") == [10_000_000, 40_000_000]


def test_unwritable_json_is_refused_before_planning(capsys, tmp_path):
    err = _error(capsys, _with({"--json": str(tmp_path / "no" / "dir" / "x.json")}))
    assert "--json" in err and "does not exist" in err
    err = _error(capsys, _with({"--json": str(tmp_path)}))
    assert "--json" in err and "is a directory" in err


# -- hand-written profiles -------------------------------------------------------------------------------------
def _profile(tmp_path, **change) -> str:
    d = hardware_preset("dgx-a100").to_json()
    for key, value in change.items():
        d[key] = value
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(d))
    return str(path)


def _link(**ops):
    return {op: {"alpha_s": 3e-6, "bytes_per_s": bw} for op, bw in ops.items()}


BAD_PROFILES = [
    ({"links": {"intra": _link(all_reduce=1.6e11), "inter": _link(all_reduce=1.25e8)}},
     "'links.intra.all_gather' is missing"),
    ({"gpu_memory_bytes": "80GB"}, "'gpu_memory_bytes' must be a positive integer, got '80GB'"),
    ({"links": {"intra": _link(all_gather=1.6e11), "inter": _link(all_gather=0)}},
     "'links.inter.all_gather.bytes_per_s' must be a positive number, got 0"),
    ({"compute_flops": 0}, "'compute_flops' must be a positive number, got 0"),
    ({"gpus_per_node": None}, "'gpus_per_node' must be a positive integer"),
    ({"links": {"intra": _link(all_gather=1e9)}}, "'links.inter' is missing"),
    ({"links": {"intra": _link(all_gather=1e9), "inter": {"all_gather": {"alpha_s": 1e-6}}}},
     "'links.inter.all_gather' must be"),
    ({"compute_by_model": {"gpt-32x4096": "fast"}}, "'compute_by_model.gpt-32x4096' must be a positive number"),
]


@pytest.mark.parametrize("change, field", BAD_PROFILES, ids=range(len(BAD_PROFILES)))
def test_a_bad_profile_file_is_a_cli_error_naming_file_and_field(capsys, tmp_path, change, field):
    path = _profile(tmp_path, **change)
    argv = _with({"--hardware": None, "--profile": path})
    err = _error(capsys, argv)
    assert f"--profile {path}" in err and field in err, err


def test_a_missing_field_and_non_json_name_the_file(capsys, tmp_path):
    d = hardware_preset("dgx-a100").to_json()
    del d["peak_flops"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    assert "'peak_flops' is missing" in _error(capsys, _with({"--hardware": None, "--profile": str(path)}))
    path.write_text("not json")
    assert f"--profile {path}" in _error(capsys, _with({"--hardware": None, "--profile": str(path)}))


def test_a_bad_profile_file_is_a_pretrain_gpt_error_naming_plan_profile(capsys, tmp_path):
    from megatron_ext.training.arguments import parse_args

    path = _profile(tmp_path, gpu_memory_bytes="80GB")
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--mock-data", "--auto-plan",
            "--plan-profile", path]
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=4)
    assert e.value.code == 2
    err = capsys.readouterr().err.split("error:", 1)[1]
    assert f"--plan-profile {path}" in err and "'gpu_memory_bytes'" in err, err
    assert "Traceback" not in err
