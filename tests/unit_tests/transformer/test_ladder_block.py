"""Ladder / Desync blocks against the hand-written reference (eq. 2, section 5) at TP = 1, 2, 4 on gloo."""
from __future__ import annotations

import torch

from unit_tests.test_utilities import Utils
from unit_tests.transformer.equivalence import errors_against_reference, full_params

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
    # the block input itself (not a copy) is the first checkpoint's input, split over TP in place
    "ladder_recompute_distributed": (dict(ladder_residual=True, **RECOMPUTE, distribute_saved_activations=True),
                                     lambda tp: dict(ladder_layers=L)),
    # megatron's uniform chunks [0, 1], [2] split at the standard -> ladder boundary; inputs split over TP
    "hybrid_recompute_uniform_distributed": (
        dict(ladder_residual=True, ladder_residual_layers=2, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=2, distribute_saved_activations=True), lambda tp: dict(ladder_layers=2)),
}


def _compare(tp: int, names):
    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch

    full = full_params(SHAPE)
    Utils.initialize_model_parallel(tp, 1)
    out = {}
    try:
        b = synthetic_gpt_batch(2, SHAPE["seq_length"], SHAPE["vocab_size"], seed=3)
        for name in names:
            kw, wiring = CASES[name]
            out[name] = errors_against_reference(build_gpt_model(**SHAPE, **kw), full, SHAPE, wiring(tp), b)
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


def _desync_dropout_vs_standard():
    """TP=1: desync reduces nothing, so with hidden dropout it must be the standard model draw for draw."""
    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.models.weights import load_full_state_dict

    full = full_params(SHAPE)
    Utils.initialize_model_parallel(1, 1)
    try:
        b = synthetic_gpt_batch(2, SHAPE["seq_length"], SHAPE["vocab_size"], seed=3)
        runs = {}
        for name, kw in (("standard", {}), ("desync2x", dict(desync_residual="2x")),
                         ("no_dropout", dict(hidden_dropout=0.0))):
            model = build_gpt_model(**SHAPE, **{"hidden_dropout": 0.3, **kw})
            load_full_state_dict(model, full)
            model.train()
            torch.manual_seed(11)
            loss = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean()
            loss.backward()
            runs[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
        (std, g_std), (des, g_des), (plain, _) = runs["standard"], runs["desync2x"], runs["no_dropout"]
        return abs(std - des), max((g_std[n] - g_des[n]).abs().max().item() for n in g_std), abs(std - plain)
    finally:
        Utils.destroy_model_parallel()


def test_desync_with_hidden_dropout_equals_standard_at_tp1(spawn):
    ((loss_err, grad_err, dropout_effect),) = spawn(_desync_dropout_vs_standard, 1)
    assert dropout_effect > 1e-3, "dropout did not change the loss: the test would not see a wrong mask"
    # Same operations in the same order (x / 1 is exact), so only summation order could differ.
    assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
