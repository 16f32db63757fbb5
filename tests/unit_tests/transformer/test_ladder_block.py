"""Ladder / Desync blocks against the hand-written reference (eq. 2, section 5) at TP = 1, 2, 4 on gloo."""
from __future__ import annotations

import pytest
import torch

from unit_tests.test_utilities import Utils
from unit_tests.transformer import ladder_reference as ref

L, HEADS = 3, 4
SHAPE = dict(num_layers=L, hidden_size=32, num_attention_heads=HEADS, ffn_hidden_size=64, vocab_size=64,
             seq_length=8)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

# name -> (build_gpt_model kwargs, reference wiring given tp)
CASES = {
    "standard": ({}, lambda tp: {}),
    "ladder": (dict(ladder_residual=True), lambda tp: dict(ladder_layers=L)),
    "ladder_no_bwd_overlap": (dict(ladder_residual=True, ladder_backward_overlap=False),
                              lambda tp: dict(ladder_layers=L)),
    "hybrid_upper2": (dict(ladder_residual=True, ladder_residual_layers=2), lambda tp: dict(ladder_layers=2)),
    "ladder_recompute": (dict(ladder_residual=True, **RECOMPUTE), lambda tp: dict(ladder_layers=L)),
    "hybrid_recompute_block": (dict(ladder_residual=True, ladder_residual_layers=2, recompute_granularity="full",
                                    recompute_method="block", recompute_num_layers=2),
                               lambda tp: dict(ladder_layers=2)),
    "desync2x": (dict(desync_residual="2x"), lambda tp: dict(desync="2x", k=tp)),
    "desync4x": (dict(desync_residual="4x"), lambda tp: dict(desync="4x", k=tp)),
    "desync4x_recompute": (dict(desync_residual="4x", **RECOMPUTE), lambda tp: dict(desync="4x", k=tp)),
}


def _full_params():
    """TP=1 megatron weights plus noise (so biases are non-zero and the bias-once rule is tested)."""
    from megatron_ext.models import build_gpt_model
    from megatron_ext.models.weights import full_parameters

    Utils.initialize_model_parallel(1, 1)
    try:
        full = full_parameters(build_gpt_model(**SHAPE))
    finally:
        Utils.destroy_model_parallel()
    g = torch.Generator().manual_seed(7)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in full.items()}


def _compare(tp: int, names):
    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.models.weights import global_name, load_full_state_dict, shard_of

    full = _full_params()
    Utils.initialize_model_parallel(tp, 1)
    out = {}
    try:
        b = synthetic_gpt_batch(2, SHAPE["seq_length"], SHAPE["vocab_size"], seed=3)
        for name in names:
            kw, wiring = CASES[name]
            model = build_gpt_model(**SHAPE, **kw)
            load_full_state_dict(model, full)
            model.train()
            losses = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            losses.mean().backward()
            params = {n: t.clone().requires_grad_() for n, t in full.items()}
            expected = ref.gpt_losses(params, b["tokens"], b["labels"], L, HEADS, **wiring(tp))
            expected.mean().backward()
            loss_err = (losses.detach() - expected.detach()).abs().max().item()
            grad_err = max((p.grad - shard_of(model, n, params[global_name(model, n)].grad)).abs().max().item()
                           for n, p in model.named_parameters())
            out[name] = (loss_err, grad_err, expected.mean().item())
    finally:
        Utils.destroy_model_parallel()
    return out


def _check(results, names):
    for rank_result in results:
        for name in names:
            loss_err, grad_err, loss = rank_result[name]
            assert loss_err < 1e-5, f"{name}: loss differs from the reference by {loss_err}"
            assert grad_err < 1e-5, f"{name}: gradient differs from the reference by {grad_err}"


def test_tp1_equals_reference(spawn):
    names = ["standard", "ladder", "hybrid_upper2", "ladder_recompute", "desync2x", "desync4x"]
    _check(spawn(_compare, 1, 1, names), names)


def test_tp2_equals_tp1_ladder_and_desync_simulation(spawn):
    names = list(CASES)
    _check(spawn(_compare, 2, 2, names), names)


def test_tp4_equals_tp1_ladder_and_desync_simulation(spawn):
    names = ["ladder", "hybrid_upper2", "desync2x", "desync4x"]
    _check(spawn(_compare, 4, 4, names), names)
