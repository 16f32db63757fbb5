"""Ladder communication schedule: forward reductions waited one module later, backward reductions overlapped."""
from __future__ import annotations

import pytest
import torch

from unit_tests.test_utilities import Utils

SHAPE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=8)


def _trace_backward():
    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.transformer import comm

    Utils.initialize_model_parallel(2, 1)
    try:
        model = build_gpt_model(**SHAPE, ladder_residual=True)
        b = synthetic_gpt_batch(2, SHAPE["seq_length"], SHAPE["vocab_size"])
        loss = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean()
        comm.TRACE = []
        loss.backward()
        return list(comm.TRACE)
    finally:
        comm.TRACE = None
        Utils.destroy_model_parallel()


def test_backward_reduction_of_module_k_overlaps_module_k_plus_1(spawn):
    trace = spawn(_trace_backward, 2)[0]
    pos = {ev: i for i, ev in enumerate(trace)}
    modules = 2 * SHAPE["num_layers"]
    for k in range(modules):
        assert pos[("grad_launch", k)] < pos[("grad_wait", k)] < pos[("module_backward", k)]
        if k + 1 < modules:
            # module k+1's backward runs while module k's output-gradient all-reduce is in flight
            assert pos[("grad_launch", k)] < pos[("module_backward", k + 1)] < pos[("grad_wait", k)], trace


def _sequence_parallel_rejected():
    from megatron_ext.models import build_gpt_model

    Utils.initialize_model_parallel(2, 1)
    try:
        with pytest.raises(ValueError, match="sequence-parallel"):
            build_gpt_model(**SHAPE, ladder_residual=True, sequence_parallel=True)
        return True
    finally:
        Utils.destroy_model_parallel()


def test_sequence_parallel_is_rejected_clearly(spawn):
    assert spawn(_sequence_parallel_rejected, 2) == [True, True]


def test_flag_validation():
    from megatron_ext.transformer import LadderConfig

    with pytest.raises(ValueError, match="2x or 4x"):
        LadderConfig(desync="3x")
    with pytest.raises(ValueError, match="pick one"):
        LadderConfig(ladder=True, desync="2x")
    with pytest.raises(ValueError, match="needs --ladder-residual"):
        LadderConfig(ladder_layers=2)
    with pytest.raises(ValueError, match="exceeds"):
        LadderConfig(ladder=True, ladder_layers=5).num_ladder_layers(4)
    assert [LadderConfig(desync="4x").reduces(m) for m in range(8)] == [False, False, False, True] * 2
    assert [LadderConfig(desync="2x").reduces(m) for m in range(4)] == [False, True, False, True]
