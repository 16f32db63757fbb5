"""The LR schedule through pretrain_gpt: Megatron's warmup/decay/min-lr formula, and resuming with other schedule
flags (Megatron-LM's --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler; neither = an error)."""
from __future__ import annotations

import contextlib
import io
import math
import os

from .test_pretrain_gpt import _data_flags

MAX_LR, MIN_LR, WARMUP, DECAY = 2e-3, 1e-4, 2, 5


def megatron_lr(iteration: int, max_lr: float) -> float:
    """Megatron-LM's schedule after ``iteration`` steps: linear warmup from 0, cosine decay to min-lr, then min-lr
    (written out here from the formula, independently of megatron-core's OptimizerParamScheduler)."""
    if iteration <= WARMUP:
        return max_lr * iteration / WARMUP
    if iteration > DECAY:
        return MIN_LR
    ratio = (iteration - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + (max_lr - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _schedule_runs(base, ckpt):
    import torch.distributed as dist

    from megatron_ext.training.checkpointing import TRACKER, CheckpointError
    from megatron_ext.training.pretrain_gpt import pretrain

    straight = pretrain(base + ["--save", ckpt, "--save-interval", "3"])
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt, TRACKER), "w") as f:
            f.write("3")  # resume from iteration 3 of the straight run
    dist.barrier()
    resume = base + ["--load", ckpt, "--lr", "1e-3", "--exit-interval", "4"]
    try:
        pretrain(resume)
        error = "no error"
    except CheckpointError as e:
        error = str(e)
    out = {}
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = pretrain(resume + [flag])
        out[flag] = (result["log"], printed.getvalue())
    return straight["log"], error, out


def test_lr_schedule_and_resume_with_other_schedule_flags(spawn, text_dataset, tiny_model_flags, tmp_path):
    base = tiny_model_flags + _data_flags(text_dataset) + [
        "--global-batch-size", "2", "--train-iters", "6", "--lr", str(MAX_LR), "--min-lr", str(MIN_LR),
        "--lr-warmup-iters", str(WARMUP), "--lr-decay-iters", str(DECAY), "--lr-decay-style", "cosine"]
    straight, error, resumed = spawn(_schedule_runs, 1, base, str(tmp_path / "ckpt"), timeout=150)[0]

    assert sorted(straight) == [1, 2, 3, 4, 5, 6]  # warmup (1, 2), cosine decay (3, 4, 5), min-lr after (6)
    for it, logged in straight.items():
        assert math.isclose(logged["lr"], megatron_lr(it, MAX_LR), rel_tol=1e-12), (it, logged["lr"])
    assert straight[6]["lr"] == MIN_LR

    # Default: the checkpoint's schedule (--lr 2e-3) and this run's (--lr 1e-3) differ -> an error naming both ways.
    assert "--lr: checkpoint 0.002, this run 0.001" in error, error
    assert "--override-opt_param-scheduler" in error and "--use-checkpoint-opt_param-scheduler" in error
    # Override: this run's --lr, continued from the checkpoint's step count. Use-checkpoint: the straight run's LR.
    for flag, expected in (("--override-opt_param-scheduler", megatron_lr(4, 1e-3)),
                           ("--use-checkpoint-opt_param-scheduler", megatron_lr(4, MAX_LR))):
        log, printed = resumed[flag]
        assert sorted(log) == [4] and math.isclose(log[4]["lr"], expected, rel_tol=1e-12), (flag, log)
        assert f"learning rate: {expected:.6E}" in printed, printed
    assert math.isclose(resumed["--use-checkpoint-opt_param-scheduler"][0][4]["lr"], straight[4]["lr"],
                        rel_tol=1e-12)


def _warmup_fraction_and_wd_ramp(argv):
    """(lr, weight decay of a decayed group, of a no-decay group) after each of 10 scheduler steps, as
    pretrain_gpt builds the optimizer and its scheduler from ``argv``."""
    import torch

    import megatron_ext as mx
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.pretrain_gpt import _build_optimizer

    args = parse_args(argv, world_size=1)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    module[2].weight.is_embedding_or_output_parameter = True   # as megatron-core's GPTModel marks its output layer
    model = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=1000))
    opt, sched = _build_optimizer(args, model)
    out = []
    for _ in range(10):
        sched.step(increment=args.global_batch_size)
        default = [g for g in opt.param_groups if g["default_config"]]
        wds = sorted({g["weight_decay"] for g in default})
        out.append((default[0]["lr"], wds, [g["lr"] for g in opt.param_groups if not g["default_config"]]))
    return out


def test_lr_warmup_fraction_and_weight_decay_ramp_follow_megatron_lm():
    """--lr-warmup-fraction warms up over that fraction of the decay's samples, --decoupled-lr gives the output
    layer its own peak, and --weight-decay-incr-style
    linear ramps --start-weight-decay to --end-weight-decay over --train-iters, each as Megatron-LM computes
    them (written out here from its formulas); parameters without decay (biases, norms) stay at 0."""
    from unit_tests.dist_harness import run_distributed   # (the spawn fixture's module: one forkserver)

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "10",
            "--lr-decay-style", "constant", "--lr-warmup-fraction", "0.4", "--weight-decay-incr-style", "linear",
            "--start-weight-decay", "0.0", "--end-weight-decay", "0.1", "--distributed-backend", "gloo",
            "--decoupled-lr", "3e-3"]
    steps = run_distributed(_warmup_fraction_and_wd_ramp, 1, argv, timeout=120)[0]
    warmup_samples = 0.4 * 10 * 2   # lr_warmup_fraction * lr_decay_steps (samples), as Megatron-LM
    for i, (lr, wds, decoupled) in enumerate(steps, start=1):
        samples = 2 * i
        want_lr = 1e-3 * samples / warmup_samples if samples <= warmup_samples else 1e-3
        assert math.isclose(lr, want_lr, rel_tol=1e-12), (i, lr, want_lr)
        # --decoupled-lr: the output layer's own group, on the same schedule to its own peak
        assert len(decoupled) == 1 and math.isclose(decoupled[0], 3 * want_lr, rel_tol=1e-12), (i, decoupled)
        assert wds[0] == 0.0 and math.isclose(wds[-1], 0.1 * samples / 20, rel_tol=1e-12, abs_tol=0.0), (i, wds)
