"""--rampup-batch-size: Megatron-LM's batch-size ramp-up through pretrain_gpt."""
from __future__ import annotations

import os

import pytest

from megatron_ext.training.arguments import parse_args
from megatron_ext.training.checkpointing import TRACKER

from .test_checkpoint_resume import _runs
from .test_pretrain_gpt import _data_flags

# 2 ranks x micro-batch 2: global batches of 4 and 8. Ramp 4 -> 8 over 16 samples, 40 samples in all: the batch is
# 4 while at most 16 samples are consumed (iterations 1-4, Megatron-LM's "consumed <= ramp"), then 8 (5-7).
RAMP = ["--global-batch-size", "8", "--train-samples", "40", "--rampup-batch-size", "4", "4", "16"]


def _sample_based(tiny_model_flags):
    flags = list(tiny_model_flags)
    i = flags.index("--lr-warmup-iters")
    return flags[:i] + ["--lr-warmup-samples", "8"] + flags[i + 2:]


def test_iterations_and_batch_sizes_follow_megatron_lm(capsys):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--lr", "1e-3"]
    assert parse_args(base + RAMP, world_size=2).train_iters == 7
    # 4 -> 16 by 4 over 90 samples (30 per increment), 200 samples: 8 batches of 4, 4 of 8, 3 of 12 (100 samples),
    # then 6 of 16
    args = parse_args(base + ["--global-batch-size", "16", "--train-samples", "200", "--rampup-batch-size", "4", "4",
                              "90"], world_size=2)
    consumed, iters = 0, 0
    while consumed <= 90:
        consumed += min(16, 4 + 4 * int(consumed / 30))
        iters += 1
    assert (iters, consumed) == (15, 100) and args.train_iters == iters + (200 - consumed) // 16 == 21

    def error(ramp, extra=("--train-samples", "40")):
        with pytest.raises(SystemExit):
            parse_args(base + ["--global-batch-size", "8", *extra, "--rampup-batch-size", *ramp], world_size=2)
        return capsys.readouterr().err

    assert "needs --train-samples" in error(["4", "4", "16"], extra=("--train-iters", "5"))
    assert "the batch sizes [6] of the ramp are not multiples of --micro-batch-size (2) x data-parallel size (2)" \
        in error(["6", "2", "16"])
    assert "must be below --global-batch-size (8) by a multiple of INCREMENT" in error(["8", "4", "16"])
    assert "SAMPLES (0) must be positive" in error(["4", "4", "0"])   # megatron-core would divide by zero
    # fewer samples than one full batch still train during the ramp; Megatron-LM's count runs the batch that
    # reaches --train-samples exactly too (consumed 12 <= 12): 4 batches of 4
    assert parse_args(base + ["--global-batch-size", "16", "--train-samples", "12", "--rampup-batch-size", "4", "4",
                              "100"], world_size=2).train_iters == 4


def test_ramped_run_trains_as_the_small_batch_then_resumes_mid_ramp(spawn, text_dataset, tiny_model_flags, tmp_path):
    """The ramp's first four iterations (batch 4) equal a run at --global-batch-size 4 bit for bit (same samples in
    the same order, the same schedule in samples); the batch then doubles; a checkpoint saved mid-ramp resumes with
    the ramp's batch sizes and the straight run's losses."""
    base = _sample_based(tiny_model_flags) + _data_flags(text_dataset)
    ckpt = str(tmp_path / "ckpt")
    ramped, small = spawn(_runs, 2, [base + RAMP + ["--save", ckpt, "--save-interval", "3"],
                                     base + ["--global-batch-size", "4", "--train-samples", "40", "--exit-interval",
                                             "4"]], timeout=200)[-1]
    assert {i: v["global_batch_size"] for i, v in ramped["log"].items()} == {1: 4, 2: 4, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8}
    assert ramped["consumed_train_samples"] == 40
    # as Megatron-LM, with --save a checkpoint before each ramp step (iteration 4) besides --save-interval's
    assert {"iter_0000003", "iter_0000004", "iter_0000006"} <= set(os.listdir(ckpt)), os.listdir(ckpt)
    assert [ramped["losses"][i] for i in range(1, 5)] == [small["losses"][i] for i in range(1, 5)]
    with open(os.path.join(ckpt, TRACKER), "w") as f:
        f.write("3")
    resumed = spawn(_runs, 2, [base + RAMP + ["--load", ckpt]], timeout=200)[-1][0]
    assert {i: v["global_batch_size"] for i, v in resumed["log"].items()} == {4: 4, 5: 8, 6: 8, 7: 8}
    assert resumed["losses"] == {i: ramped["losses"][i] for i in range(4, 8)}


def test_ramp_with_the_interleaved_pipeline(spawn, text_dataset, tiny_model_flags, capsys):
    """PP 2 with two model chunks per stage, micro-batch 1: the ramp's batches of 2 (two micro-batches, the fewest
    the interleaved schedule takes at PP 2) equal a --global-batch-size 2 run bit for bit, then the batch is 4; a
    ramp batch the schedule cannot run is named before any process group starts."""
    vpp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
           "--micro-batch-size", "1"]
    base = _sample_based(tiny_model_flags) + _data_flags(text_dataset) + vpp
    ramped, small = spawn(_runs, 2, [base + ["--global-batch-size", "4", "--train-samples", "14",
                                             "--rampup-batch-size", "2", "2", "4"],
                                     base + ["--global-batch-size", "2", "--train-samples", "14", "--exit-interval",
                                             "2"]], timeout=200)[-1]
    sizes = {i: v["global_batch_size"] for i, v in ramped["log"].items()}
    assert sizes == {1: 2, 2: 2, 3: 4, 4: 4}, sizes   # 4 of the 14 samples at batch 2, then 2 batches of 4
    assert [ramped["losses"][i] for i in (1, 2)] == [small["losses"][i] for i in (1, 2)]
    with pytest.raises(SystemExit):
        parse_args(["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--lr", "1e-3"] + vpp
                   + ["--global-batch-size", "4", "--train-samples", "40", "--rampup-batch-size", "1", "1", "8"],
                   world_size=2)
    err = capsys.readouterr().err
    assert ("needs at least --pipeline-model-parallel-size (2) micro-batches per step, got 1 (= the "
            "--rampup-batch-size global batch 1" in err), err
