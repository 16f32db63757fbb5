"""``pretrain_gpt --auto-plan``: errors named before anything starts, and a tiny CPU run with the planner's choice
that trains exactly like the same run with the CLI's printed flags pasted."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re

import pytest

from megatron_ext.planner import cli, hardware_preset
from megatron_ext.training.arguments import ArgumentError, build_parser, parse_args, validate_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--mock-data"]
AUTO = ["--auto-plan", "--plan-hardware", "h100"]


def _error(capsys, argv, world_size=4) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + argv, world_size=world_size)
    assert e.value.code == 2
    return capsys.readouterr().err.split("error:", 1)[1]    # the message, not the usage lines


@pytest.mark.parametrize("argv, names", [
    (["--auto-plan"], ["--auto-plan", "--plan-hardware", "--plan-profile"]),
    (["--plan-hardware", "h100"], ["--plan-hardware", "--auto-plan"]),
    (["--plan-allow-quantized"], ["--plan-allow-quantized", "--auto-plan"]),
    (AUTO + ["--plan-profile", "p.json"], ["--plan-profile", "--plan-hardware"]),
    (["--auto-plan", "--plan-profile", "/no/such/profile.json"], ["--plan-profile", "/no/such/profile.json"]),
    (AUTO + ["--plan-gpu-memory", "lots"], ["--plan-gpu-memory", "lots"]),
    (AUTO + ["--plan-gpu-memory", "1MB"], ["no sharding plan fits", "--plan-gpu-memory", "needs"]),
    (AUTO + ["--param-shard-size", "2"], ["--auto-plan", "--param-shard-size"]),
    (AUTO + ["--grad-shard-size", "1"], ["--auto-plan", "--grad-shard-size"]),
    (AUTO + ["--optim-shard-size", "2"], ["--auto-plan", "--optim-shard-size"]),
    (AUTO + ["--hpz-partition-size", "2"], ["--auto-plan", "--hpz-partition-size"]),
    (AUTO + ["--grad-reduce", "plain"], ["--auto-plan", "--grad-reduce"]),      # explicit, even at the default
    (AUTO + ["--param-gather", "plain"], ["--auto-plan", "--param-gather"]),
    (AUTO + ["--grad-reduce", "qgz", "--qgz-bits", "8"], ["--auto-plan", "--grad-reduce"]),
    (AUTO + ["--ddp-bucket-size", "1000"], ["--auto-plan", "--ddp-bucket-size"]),
    (AUTO + ["--num-distributed-optimizer-instances", "2"], ["--auto-plan", "--num-distributed-optimizer-instances"]),
    (AUTO + ["--odo-accumulate", "local"], ["--auto-plan", "--odo-accumulate local"]),
])
def test_errors_name_the_flags(capsys, argv, names):
    err = _error(capsys, argv)
    for n in names:
        assert n in err, err


def test_help_lists_the_auto_plan_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--auto-plan", "--plan-profile FILE", "--plan-hardware", "--plan-gpu-memory SIZE",
                 "--plan-allow-quantized"):
        assert flag in out, flag


def test_unknown_hardware_is_an_argparse_choice_error(capsys):
    assert "--plan-hardware" in _error(capsys, ["--auto-plan", "--plan-hardware", "tpu-v9"])


def test_validate_args_without_the_command_line_sees_non_default_plan_flags():
    args = build_parser().parse_args(BASE + AUTO + ["--grad-reduce", "qgz"])
    with pytest.raises(ArgumentError, match="--auto-plan conflicts with --grad-reduce"):
        validate_args(args, world_size=4)
    # --odo-accumulate auto and --num-distributed-optimizer-instances 1 are the defaults: no contradiction
    ok = parse_args(BASE + AUTO + ["--odo-accumulate", "auto", "--num-distributed-optimizer-instances", "1"],
                    world_size=4)
    assert ok.auto_plan_summary.startswith("> auto-plan: ")


def test_plan_respects_the_memory_cap_and_lands_in_args():
    """With a cap at the leanest plan's memory, --auto-plan gives up the fastest plan for one that fits."""
    from megatron_ext.planner.search import solve
    from megatron_ext.training.auto_plan import workload_from_args

    argv = BASE + ["--global-batch-size", "16", "--ranks-per-node", "2"] + AUTO
    free = parse_args(argv, world_size=4)
    everything = solve(workload_from_args(free), hardware_preset("h100"), float("inf")).ranked
    fastest, cap = everything[0], min(p.memory["total"] for p in everything)
    assert fastest.memory["total"] > cap
    assert free.auto_plan_summary.endswith("flags: " + " ".join(fastest.candidate.flags()))
    # three significant digits below 10 ms: a small model's step is not "0.0 ms" (user test 6)
    printed = float(re.search(r"predicted step (\S+) ms", free.auto_plan_summary).group(1))
    assert printed == float(f"{1e3 * fastest.step_s:#.3g}") and printed > 0, free.auto_plan_summary
    capped = parse_args(argv + ["--plan-gpu-memory", str(cap)], world_size=4)
    flags = capped.auto_plan_summary.split("flags: ", 1)[1].split()
    chosen = next(p for p in everything if p.candidate.flags() == flags)
    assert chosen.memory["total"] <= cap and chosen is not fastest
    # what the summary line says is what args hold
    c = chosen.candidate
    assert (capped.param_shard_size, capped.grad_shard_size, capped.optim_shard_size) == (c.param, c.grad, c.optim)
    assert (capped.hpz_partition_size or 1, capped.ddp_bucket_size) == (c.hpz, c.bucket_size)
    assert (capped.grad_reduce, capped.param_gather) == (c.grad_reduce, c.param_gather)


def _fields(args):
    return (args.param_shard_size, args.grad_shard_size, args.optim_shard_size, args.hpz_partition_size or 1,
            args.grad_reduce, args.param_gather, args.qgz_bits, args.ddp_bucket_size)


def test_allow_quantized_widens_the_search_and_the_choice_lands_in_args():
    """2 simulated nodes of 8 on a 1-IB DGX-2 profile: lossy backends only with --plan-allow-quantized."""
    from megatron_ext.planner import parse_candidate

    argv = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "1024",
            "--micro-batch-size", "1", "--global-batch-size", "16", "--lr", "1e-4", "--train-iters", "10",
            "--mock-data", "--vocab-size", "31999", "--ranks-per-node", "8", "--bf16", "--auto-plan",
            "--plan-hardware", "dgx2-v100-1ib"]
    for extra in ([], ["--plan-allow-quantized"]):
        args = parse_args(argv + extra, world_size=16)
        c = parse_candidate(re.search(r"\((p\d+\.g\d+\.o\d+\.h\d+ \S+ b\S+)\)", args.auto_plan_summary).group(1))
        assert _fields(args) == (c.param, c.grad, c.optim, c.hpz, c.grad_reduce, c.param_gather, c.qgz_bits,
                                 c.bucket_size)
        if not extra:
            assert not c.lossy


def test_applied_flags_are_parsed_like_typed_ones():
    """A lossy candidate's flags (qgZ INT8, qwZ, hpZ) put into validated args, exactly as typing them would."""
    from megatron_ext.planner import Candidate
    from megatron_ext.training.arguments import sharding_plan_from_args
    from megatron_ext.training.auto_plan import apply_plan

    base = BASE + ["--ranks-per-node", "2", "--global-batch-size", "8"]
    cand = Candidate(4, 4, 4, 2, "qgz", "qwz", 8, 123_456)
    applied = parse_args(base, world_size=4)
    apply_plan(applied, cand.flags())
    typed = parse_args(base + cand.flags(), world_size=4)
    assert _fields(applied) == _fields(typed) == (4, 4, 4, 2, "qgz", "qwz", 8, 123_456)
    assert sharding_plan_from_args(applied, 4, 2) == sharding_plan_from_args(typed, 4, 2)


def test_megatron_lm_plugin_rejects_auto_plan_with_the_reason(capsys):
    import argparse

    import megatron_ext.megatron_lm as mxlm

    parser = mxlm.add_args(argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False))
    for argv, names in ((["--auto-plan", "--plan-hardware", "h100"], ["--auto-plan", "python -m megatron_ext.planner"]),
                        (["--plan-gpu-memory", "80GB"], ["--plan-gpu-memory", "see --auto-plan"])):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--use-overlapped-distributed-optimizer"] + argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.split("error:", 1)[1]
        for n in names + ["not supported by the Megatron-LM plug-in"]:
            assert n in err, err


# -- a tiny CPU run --------------------------------------------------------------------------------------------
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--train-iters", "2", "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0", "--mock-data", "--untie-embeddings-and-output-weights", "--ranks-per-node", "1",
        "--overlap-grad-reduce", "--overlap-param-gather"]


def _cli_flags(profile_path: str) -> list:
    """The planner CLI's flags for the TINY job: 2 GPUs on nodes of 1, NullTokenizer 1024 ids + EOD padded to
    1152, fp32."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                         "--seq-length", "64", "--vocab-size", "1152", "--untie-embeddings-and-output-weights",
                         "--gpus", "2", "--gpus-per-node", "1", "--micro-batch-size", "2", "--global-batch-size", "8",
                         "--params-dtype", "fp32", "--profile", profile_path]) == 0
    lines = out.getvalue().splitlines()
    return lines[lines.index("pretrain_gpt flags for the first plan:") + 1].split()


def _runs(argvs):
    import torch.distributed as dist

    from megatron_ext.training.pretrain_gpt import pretrain

    out = []
    for argv in argvs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            result = pretrain(argv)
        lines = [line for line in buf.getvalue().splitlines() if line.startswith("> auto-plan:")]
        out.append((dist.get_rank(), result["iteration"], result["losses"], lines))
    return out


def test_tiny_cpu_run_with_auto_plan_equals_the_pasted_cli_flags(spawn, tmp_path):
    profile = str(tmp_path / "cpu2.json")
    dataclasses.replace(hardware_preset("dgx-a100"), name="test-2x1", gpus_per_node=1).save(profile)
    flags = _cli_flags(profile)
    auto = TINY + ["--auto-plan", "--plan-profile", profile]
    assert parse_args(auto, world_size=2).auto_plan_summary.endswith("flags: " + " ".join(flags))

    ranks = spawn(_runs, 2, [auto, TINY + flags], timeout=240)
    for rank, ((r, it_a, losses_a, lines_a), (_, it_b, losses_b, lines_b)) in enumerate(ranks):
        assert r == rank and it_a == it_b == 2
        assert sorted(losses_a) == [1, 2] and all(math.isfinite(v) for v in losses_a.values())
        assert losses_a == losses_b                 # the same plan: the same training, bit for bit
        assert lines_b == [] and len(lines_a) == (1 if rank == 0 else 0)
    assert ranks[0][0][3][0].endswith("flags: " + " ".join(flags))


def _agree(labels):
    import argparse

    import torch.distributed as dist

    from megatron_ext.training.arguments import ArgumentError
    from megatron_ext.training.auto_plan import check_ranks_agree

    args = argparse.Namespace(auto_plan_label=labels[dist.get_rank()])
    try:
        check_ranks_agree(args)
    except ArgumentError as e:
        return str(e)
    return None


def test_ranks_that_planned_differently_all_fail_naming_the_profile(spawn):
    assert spawn(_agree, 2, ["p1.g1.o2.h1 plain+plain b40M"] * 2) == [None, None]
    errors = spawn(_agree, 2, ["p1.g1.o2.h1 plain+plain b40M", "p1.g2.o2.h1 plain+plain b40M"])
    assert all(e is not None and "--plan-profile" in e for e in errors)


# LLaMA-7B as pretrain_gpt flags on 64 ranks (nodes of 8), 40 GiB cap: the reviewer's case of partial recomputation.
LLAMA_7B_64 = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size",
               "11008", "--seq-length", "4096", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--bf16",
               "--micro-batch-size", "1", "--global-batch-size", "64", "--lr", "1e-4", "--train-iters", "10",
               "--mock-data", "--vocab-size", "31999", "--ranks-per-node", "8", "--auto-plan", "--plan-hardware",
               "dgx-a100", "--plan-gpu-memory", "40GB"]


def test_auto_plan_sizes_activations_for_the_layers_actually_recomputed():
    """--recompute-method block --recompute-num-layers 1 recomputes 1 of 32 layers: the other 31 keep all their
    activations, which the plan's memory must count (it used to count every layer as recomputed)."""
    from megatron_ext.planner import parse_candidate, predict
    from megatron_ext.training.auto_plan import workload_from_args

    full = ["--recompute-granularity", "full", "--recompute-num-layers", "1"]
    block = parse_args(LLAMA_7B_64 + full + ["--recompute-method", "block"], world_size=64)
    uniform = parse_args(LLAMA_7B_64 + full + ["--recompute-method", "uniform"], world_size=64)
    wl_b, wl_u = workload_from_args(block), workload_from_args(uniform)
    assert (wl_b.recompute, wl_b.recompute_method, wl_b.recompute_num_layers) == ("full", "block", 1)
    spec = wl_b.spec
    act = spec.activation_bytes(1, micro_batches=1, recompute="full", recompute_method="block",
                                recompute_num_layers=1, sequence_parallel=False)
    layer = 4096 * 4096 * 34            # Korthikanti's s b h 34 (no sequence parallelism, TP 1)
    assert act - spec.activation_bytes(1, micro_batches=1, recompute="full", sequence_parallel=False) == \
        31 * (layer - 2 * 4096 * 4096)
    prof = hardware_preset("dgx-a100")
    for args, wl in ((block, wl_b), (uniform, wl_u)):
        label = re.search(r"\((p\d+\.g\d+\.o\d+\.h\d+ \S+ b\S+)\)", args.auto_plan_summary).group(1)
        p = predict(parse_candidate(label), wl, prof)
        assert p.memory["total"] <= 40 * 2 ** 30
        assert p.memory["activations"] == spec.activation_bytes(
            1, micro_batches=1, recompute="full", recompute_method=wl.recompute_method, recompute_num_layers=1,
            sequence_parallel=False)
    # the same plan is predicted 31 layers' activations heavier with block than with uniform
    c = parse_candidate(re.search(r"\((p\d+\.g\d+\.o\d+\.h\d+ \S+ b\S+)\)", uniform.auto_plan_summary).group(1))
    diff = predict(c, wl_b, prof).memory["total"] - predict(c, wl_u, prof).memory["total"]
    assert diff == pytest.approx(31 * (layer - 2 * 4096 * 4096), abs=2 ** 20)


def test_default_cap_is_the_device_memory_less_the_reserve():
    """Without --plan-gpu-memory the cap leaves room for the CUDA context, NCCL and fragmentation; a cap typed is
    taken as given."""
    from megatron_ext.planner.profile import MEMORY_RESERVE_BYTES, MEMORY_RESERVE_FRACTION
    from megatron_ext.training.auto_plan import plan_memory_cap

    h100 = hardware_preset("h100")
    assert h100.gpu_memory_bytes == 81559 * 2 ** 20           # an H100 80GB's memory, not 80 GiB
    assert hardware_preset("dgx-a100").gpu_memory_bytes == 81920 * 2 ** 20
    default = parse_args(BASE + ["--global-batch-size", "8"] + AUTO, world_size=4)
    assert plan_memory_cap(default) == h100.default_memory_cap == int(
        h100.gpu_memory_bytes * (1 - MEMORY_RESERVE_FRACTION)) - MEMORY_RESERVE_BYTES
    assert 73 * 2 ** 30 < h100.default_memory_cap < 74 * 2 ** 30
    assert f"of {h100.default_memory_cap / 2 ** 30:.2f} GiB" in default.auto_plan_summary
    typed = parse_args(BASE + ["--global-batch-size", "8"] + AUTO + ["--plan-gpu-memory", "80GB"], world_size=4)
    assert plan_memory_cap(typed) == 80 * 2 ** 30 and "of 80.00 GiB" in typed.auto_plan_summary
