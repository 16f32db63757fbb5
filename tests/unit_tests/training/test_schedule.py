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
