"""Full-recompute grouping of a ladder/desync block: megatron's, split at the standard -> ladder boundary.

Recomputation never changes the numbers (test_ladder_block.py checks those), so the grouping is tested as data,
and the block is checked to checkpoint exactly the planned segments with the configured
distribute_saved_activations.
"""
from __future__ import annotations

import pytest

from unit_tests.test_utilities import Utils

from megatron_ext.transformer.recompute_plan import plan_segments


def _plan(method, n, first_special=0, layers=4, granularity="full", training=True):
    return [tuple(s) for s in plan_segments(layers, first_special, granularity, method, n, training)]


def test_uniform_chunks_count_from_layer_0_of_the_stage():
    assert _plan("uniform", 2) == [(0, 2, True, True), (2, 4, True, True)]
    assert _plan("uniform", 3) == [(0, 3, True, True), (3, 4, True, True)]
    # hybrid (ladder from layer 1): megatron's chunks [0, 1] and [2, 3]; the first one is split at the boundary
    assert _plan("uniform", 2, first_special=1) == [(0, 1, True, False), (1, 2, True, True), (2, 4, True, True)]
    assert _plan("uniform", 2, first_special=2) == [(0, 2, True, False), (2, 4, True, True)]


def test_block_checkpoints_each_of_the_first_n_layers_separately():
    assert _plan("block", 2) == [(0, 1, True, True), (1, 2, True, True), (2, 4, False, True)]
    assert _plan("block", 4) == [(0, 1, True, True), (1, 2, True, True), (2, 3, True, True), (3, 4, True, True)]
    assert _plan("block", 3, first_special=2) == [(0, 1, True, False), (1, 2, True, False), (2, 3, True, True),
                                                  (3, 4, False, True)]
    assert _plan("block", 1, first_special=2) == [(0, 1, True, False), (1, 2, False, False), (2, 4, False, True)]


def test_no_recompute_runs_standard_and_special_layers_as_one_segment_each():
    assert _plan(None, None, first_special=1, granularity=None) == [(0, 1, False, False), (1, 4, False, True)]
    assert _plan("uniform", 1, training=False) == [(0, 4, False, True)]  # eval: megatron never recomputes
    assert _plan("uniform", 1, granularity="selective") == [(0, 4, False, True)]


def test_full_recompute_without_a_method_raises_like_megatron():
    with pytest.raises(ValueError, match="Invalid activation recompute method"):
        plan_segments(4, 0, "full", None, 1, True)
    with pytest.raises(ValueError, match="recompute_num_layers"):
        plan_segments(4, 0, "full", "uniform", None, True)


def _checkpoint_calls():
    from megatron.core import tensor_parallel

    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch

    shape = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                 seq_length=8)
    Utils.initialize_model_parallel(2, 1)
    calls = []
    real = tensor_parallel.checkpoint

    def recording(fn, distribute, *args):
        calls.append(distribute)
        return real(fn, distribute, *args)

    try:
        model = build_gpt_model(**shape, ladder_residual=True, ladder_residual_layers=2,
                                recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
                                distribute_saved_activations=True)
        b = synthetic_gpt_batch(2, shape["seq_length"], shape["vocab_size"])
        tensor_parallel.checkpoint = recording
        try:
            model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean().backward()
        finally:
            tensor_parallel.checkpoint = real
        return [tuple(s) for s in model.decoder.segments()], calls
    finally:
        Utils.destroy_model_parallel()


def test_block_checkpoints_the_planned_segments_with_distributed_inputs(spawn):
    for segments, calls in spawn(_checkpoint_calls, 2):
        assert segments == [(0, 1, True, False), (1, 2, True, True), (2, 3, False, True)]
        assert calls == [True, True]  # one checkpoint per checkpointed segment, honouring the config
