"""``python -m megatron_ext.planner``: the table and the flags for a preset or Megatron's model flags, argparse errors
naming the flag for bad input, and the printed flags accepted by pretrain_gpt (which picks the same plan itself
with ``--auto-plan``)."""
from __future__ import annotations

import json

import pytest

from megatron_ext.planner import cli

LLAMA_7B_1024 = ["--model", "llama-7b", "--gpus", "1024", "--gpus-per-node", "8", "--gpu-memory", "80GB",
                 "--micro-batch-size", "1", "--global-batch-size", "1024", "--seq-length", "4096",
                 "--hardware", "dgx-a100"]

# The same job as pretrain_gpt flags: LLaMA-7B's shape, NullTokenizer ids 0..31998 + EOD = 32000 (a multiple of
# 128: no padding), bf16, 1024 ranks on nodes of 8.
PRETRAIN_LLAMA_7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                     "--ffn-hidden-size", "11008", "--seq-length", "4096", "--swiglu", "--normalization", "RMSNorm",
                     "--disable-bias-linear", "--position-embedding-type", "rope",
                     "--untie-embeddings-and-output-weights", "--bf16", "--micro-batch-size", "1",
                     "--global-batch-size", "1024", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
                     "--vocab-size", "31999", "--ranks-per-node", "8"]


def _printed_flags(out: str) -> list:
    lines = out.splitlines()
    i = lines.index("pretrain_gpt flags for the first plan:")
    return lines[i + 1].split()


def test_llama_7b_on_1024_gpus_table_flags_and_pretrain_gpt(capsys, tmp_path):
    from megatron_ext.training.arguments import parse_args

    path = tmp_path / "ranking.json"
    assert cli.main(LLAMA_7B_1024 + ["--top", "5", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model llama-7b: 6.74B parameters; DP 1024 (8 per node)" in out and "memory cap 80.0 GiB" in out
    header = next(line for line in out.splitlines() if "step ms" in line)
    assert all(col in header for col in ("plan", "exposed ms", "MFU", "GiB/GPU", "why"))
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 5 and "fastest that fits" in rows[0]
    flags = _printed_flags(out)
    saved = json.loads(path.read_text())
    assert saved["ranked"][0]["flags"] == flags and len(saved["ranked"]) == 5
    assert all(row["memory"]["total"] <= 80 * 2 ** 30 for row in saved["ranked"])

    # pasted into pretrain_gpt (parse + validation, as for a 1024-rank launch), the flags mean that plan
    args = parse_args(PRETRAIN_LLAMA_7B + flags, world_size=1024)
    value = dict(zip(flags[::2], flags[1::2]))
    assert (args.param_shard_size, args.grad_shard_size, args.optim_shard_size) == tuple(
        int(value[f]) for f in ("--param-shard-size", "--grad-shard-size", "--optim-shard-size"))
    assert args.ddp_bucket_size == int(value["--ddp-bucket-size"])
    assert (args.grad_reduce, args.param_gather) == (value["--grad-reduce"], value["--param-gather"])
    # and pretrain_gpt --auto-plan, asking the same question, gets the same answer
    auto = parse_args(PRETRAIN_LLAMA_7B + ["--auto-plan", "--plan-hardware", "dgx-a100", "--plan-gpu-memory", "80GB"],
                      world_size=1024)
    assert auto.auto_plan_summary.endswith("flags: " + " ".join(flags))
    for dest in ("param_shard_size", "grad_shard_size", "optim_shard_size", "hpz_partition_size", "grad_reduce",
                 "param_gather", "qgz_bits", "ddp_bucket_size"):
        assert getattr(auto, dest) == getattr(args, dest), dest


def test_megatron_model_flags_and_a_profile_file(capsys, tmp_path):
    import dataclasses

    from megatron_ext.planner import hardware_preset

    prof = tmp_path / "prof.json"
    dataclasses.replace(hardware_preset("h100"), name="my-h100").save(str(prof))
    argv = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--vocab-size", "32000",
            "--seq-length", "1024", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--position-embedding-type", "rope", "--gpus", "16", "--micro-batch-size", "2",
            "--global-batch-size", "64", "--profile", str(prof), "--allow-quantized", "--top", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "model gpt-4x512" in out and "hardware my-h100" in out and "DP 16 (8 per node)" in out
    assert "--param-shard-size" in _printed_flags(out)


@pytest.mark.parametrize("change, names", [
    ({"--global-batch-size": "1000"}, ["--global-batch-size", "--micro-batch-size"]),
    ({"--gpu-memory": "lots"}, ["--gpu-memory"]),
    ({"--gpus": "1004"}, ["do not fill nodes", "--gpus-per-node"]),
    ({"--model": None}, ["--model", "--num-layers", "--hidden-size"]),
    ({"--hardware": "tpu"}, ["--hardware"]),
    ({"--gpu-memory": "1GB"}, ["no plan fits", "--gpu-memory", "the leanest of", "GiB;"]),
], ids=["batch-not-multiple", "memory-unreadable", "partial-node", "no-model", "unknown-hardware", "cap-too-small"])
def test_bad_input_is_an_argparse_error_naming_the_flag(capsys, change, names):
    argv = list(LLAMA_7B_1024)
    for flag, value in change.items():
        i = argv.index(flag)
        argv[i:i + 2] = [] if value is None else [flag, value]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.split("error:", 1)[1]     # the message, not the usage lines
    for n in names:
        assert n in err, err


def test_model_flags_mean_what_pretrain_gpt_builds():
    """--group-query-attention alone is one query group, --swiglu alone Megatron-LM's FFN size, --qk-layernorm
    adds its norms: the planner's model is the one pretrain_gpt builds from the same flags."""
    shape = ["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32", "--vocab-size", "32000",
             "--seq-length", "64", "--gpus", "8", "--micro-batch-size", "1", "--global-batch-size", "8"]
    spec = cli.model_from_args(cli.build_parser().parse_args(shape + ["--group-query-attention", "--swiglu"]))
    assert spec.query_groups == 1 and spec.ffn == 10880
    plain = cli.model_from_args(cli.build_parser().parse_args(shape))
    normed = cli.model_from_args(cli.build_parser().parse_args(shape + ["--qk-layernorm"]))
    assert plain.query_groups == 32 and plain.ffn == 4 * 4096
    assert normed.num_params - plain.num_params == 2 * 2 * 2 * 128   # layers x (q, k) x (weight, bias) x head


def test_sequence_parallel_reaches_the_plan_and_ranks_like_auto_plan(capsys):
    """--sequence-parallel: the CLI's ranking for TP 2 with sequence parallelism is --auto-plan's for the same run
    (its activations and the deferred buckets of the sequence-parallel norms differ from the run without)."""
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.auto_plan import choose

    job = ["--gpus", "64", "--gpus-per-node", "8", "--micro-batch-size", "1", "--global-batch-size", "64",
           "--tensor-model-parallel-size", "2", "--hardware", "dgx-a100", "--gpu-memory", "30GB"]
    argv = PRETRAIN_LLAMA_7B[:PRETRAIN_LLAMA_7B.index("--bf16")] + ["--vocab-size", "32000"] + job
    with_sp = cli.plan_from_args(cli.build_parser().parse_args(argv + ["--sequence-parallel"]))
    without = cli.plan_from_args(cli.build_parser().parse_args(argv))
    assert with_sp.workload.sequence_parallel and not without.workload.sequence_parallel
    assert with_sp.ranked[0].memory["activations"] < without.ranked[0].memory["activations"]
    assert cli.main(argv + ["--sequence-parallel"]) == 0
    flags = _printed_flags(capsys.readouterr().out)
    pretrain = ["64" if f == "1024" else f for f in PRETRAIN_LLAMA_7B]     # --global-batch-size 64
    # pretrain_gpt takes --sequence-parallel with Transformer Engine only (not importable here): the flags are
    # validated without it and the planner asked with it, as --auto-plan asks it
    args = parse_args(pretrain + ["--tensor-model-parallel-size", "2", "--auto-plan", "--plan-hardware",
                                  "dgx-a100", "--plan-gpu-memory", "30GB"], world_size=64)
    args.sequence_parallel = True
    ranking, best = choose(args)
    wl = ranking.workload
    assert (wl.sequence_parallel, wl.tp, wl.dp, wl.micro_batches) == (True, 2, 32, 2)
    assert best.candidate.flags() == flags


def test_default_cap_is_printed_and_a_given_one_kept(capsys):
    """No --gpu-memory: the profile's device memory less the reserve (73.7 GiB of an H100 80GB's 79.6)."""
    argv = [a for a in LLAMA_7B_1024 if a not in ("--gpu-memory", "80GB")]
    argv[argv.index("dgx-a100")] = "h100"
    assert cli.main(argv + ["--top", "1"]) == 0
    assert "memory cap 73.7 GiB" in capsys.readouterr().out


def test_a_preset_model_uses_the_profiles_measured_compute_rate():
    """calibrate_comm keys a measured compute rate by gpt_name(layers, hidden); --model llama-7b is that shape."""
    import dataclasses

    from megatron_ext.planner import hardware_preset, parse_candidate, predict
    from megatron_ext.planner.model_spec import gpt_name

    base = hardware_preset("dgx-a100")
    measured = dataclasses.replace(base, compute_by_model={gpt_name(32, 4096): base.compute_flops / 2})
    a = cli.build_parser().parse_args(LLAMA_7B_1024)
    spec = cli.model_from_args(a)
    assert spec.name == "llama-7b"
    wl = cli.workload_from(spec, gpus=1024, gpus_per_node=8, micro_batch=1, global_batch=1024)
    c = parse_candidate("p1.g8.o8.h1 plain+plain b40M")
    slow, fast = predict(c, wl, measured), predict(c, wl, base)
    per_micro = spec.flops_per_sequence() / base.compute_flops
    assert slow.compute_s - fast.compute_s == pytest.approx(per_micro, rel=1e-6)   # each of 1 + 0 micro-batches


def test_tie_a_preset_and_the_help_says_what_the_presets_are(capsys):
    tied = cli.model_from_args(cli.build_parser().parse_args(
        ["--model", "gpt-18b", "--tie-embeddings-and-output-weights"] + LLAMA_7B_1024[2:]))
    untied = cli.model_from_args(cli.build_parser().parse_args(["--model", "gpt-18b"] + LLAMA_7B_1024[2:]))
    assert not tied.untie_embeddings and untied.untie_embeddings
    assert untied.num_params - tied.num_params == 50304 * 6144
    with pytest.raises(SystemExit):
        cli.main(LLAMA_7B_1024 + ["--tie-embeddings-and-output-weights", "--untie-embeddings-and-output-weights"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "every --model preset is untied" in help_text and "--tie-embeddings-and-output-weights" in help_text
    assert "--sequence-parallel" in help_text and "--recompute-method" in help_text


def test_model_flags_with_a_preset_are_named_in_the_header(capsys):
    """--model with Megatron's model flags plans the changed shape and says so (not 'llama-7b' for a 4-layer model)."""
    assert cli.main(LLAMA_7B_1024 + ["--num-layers", "4", "--untie-embeddings-and-output-weights"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("model llama-7b with --num-layers 4: 1.07B "), header   # the preset is untied already
