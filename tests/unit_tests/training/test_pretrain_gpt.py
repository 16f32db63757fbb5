"""End-to-end pretrain_gpt on CPU gloo worlds: TP x DP and PP x DP on preprocess_data output, loss falling."""
from __future__ import annotations

import pytest


def _train(argv):
    from megatron_ext.training.pretrain_gpt import pretrain

    return pretrain(argv)


def _data_flags(text_dataset):
    prefix, tok = text_dataset
    return ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok,
            "--split", "90,10,0"]


@pytest.mark.parametrize("parallel", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2xdp2", "pp2xdp2"])
def test_loss_decreases(spawn, text_dataset, tiny_model_flags, parallel):
    argv = tiny_model_flags + _data_flags(text_dataset) + parallel + [
        "--global-batch-size", "8", "--train-iters", "8", "--eval-iters", "1", "--eval-interval", "8",
        "--ranks-per-node", "2"]
    results = spawn(_train, 4, argv, timeout=200)
    last = results[-1]  # the last rank is on the last pipeline stage and holds the loss
    losses = [last["losses"][i] for i in sorted(last["losses"])]
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    assert 8 in last["eval"]
