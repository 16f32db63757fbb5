"""Ladder / desync models under megatron-core's static inference context: a prefill then decode steps with the
KV cache give the logits of one full forward over the concatenated sequence (TP=1 and TP=2 on gloo)."""
from __future__ import annotations

import pytest
import torch

from unit_tests.dist_harness import run_distributed
from unit_tests.test_utilities import Utils

SHAPE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=8)
PROMPT, NEW, BATCH = 5, 2, 2
VARIANTS = {
    "standard": {},
    "ladder": dict(ladder_residual=True),
    "hybrid_upper2": dict(ladder_residual=True, ladder_residual_layers=2),
    "desync2x": dict(desync_residual="2x"),
    "desync4x": dict(desync_residual="4x"),
}


def _decode_errors(model, tokens: torch.Tensor) -> float:
    """Max |logit| difference between prefill + KV-cache decode steps and one full forward (last positions)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_ext.compat import causal_attention_mask

    n = tokens.shape[1]
    pos = torch.arange(n).expand(tokens.shape[0], -1)
    model.eval()
    with torch.no_grad():
        full = model(tokens, pos, causal_attention_mask(n), runtime_gather_output=True)
        ctx = StaticInferenceContext(tokens.shape[0], n)
        steps = [model(tokens[:, :PROMPT], pos[:, :PROMPT], causal_attention_mask(PROMPT), inference_context=ctx,
                       runtime_gather_output=True)]  # only the last position's logits are materialised
        ctx.increment_sequence_len_offset(PROMPT)
        ctx.enable_decode_mode()
        for t in range(PROMPT, n):
            steps.append(model(tokens[:, t:t + 1], pos[:, t:t + 1], None, inference_context=ctx,
                               runtime_gather_output=True))
            ctx.increment_sequence_len_offset(1)
    assert len(ctx.key_value_memory_dict) == SHAPE["num_layers"], "the KV cache was not used"
    return max((out[:, -1] - full[:, p]).abs().max().item() for out, p in zip(steps, range(PROMPT - 1, n)))


def _world():
    """Each rank of a 2-process world: TP=1 (as two data-parallel replicas), then TP=2."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_ext.models import build_gpt_model

    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, PROMPT + NEW), generator=torch.Generator().manual_seed(0))
    out = {}
    for tp in (1, 2):
        Utils.initialize_model_parallel(tp, 1)
        try:
            out[tp] = {name: _decode_errors(build_gpt_model(**SHAPE, **kw), tokens) for name, kw in VARIANTS.items()
                       if tp == 1 or name != "standard"}
        finally:
            Utils.destroy_model_parallel()
    # the ladder decoder is built once, where (and with the random numbers) a standard one would be
    Utils.initialize_model_parallel(1, 1)
    try:
        built = []
        init = TransformerBlock.__init__
        TransformerBlock.__init__ = lambda self, *a, **k: (built.append(type(self).__name__), init(self, *a, **k))[1]
        states = {}
        try:
            for name in ("standard", "ladder"):
                torch.manual_seed(5)
                states[name] = build_gpt_model(**SHAPE, **VARIANTS[name]).state_dict()
        finally:
            TransformerBlock.__init__ = init
        same = all(torch.equal(v, states["ladder"][k]) for k, v in states["standard"].items()
                   if isinstance(v, torch.Tensor))
        out["build"] = (built, same)
    finally:
        Utils.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world, 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_decode_equals_full_forward(world, tp):
    for rank in world:
        for name, err in rank[tp].items():
            # same per-token arithmetic, only the attention reduction length differs: float32 rounding
            assert err < 1e-5, f"TP={tp} {name}: decode logits differ from the full forward by {err}"


def test_ladder_decoder_is_built_once_with_the_standard_weights(world):
    built, same = world[0]["build"]
    assert built == ["TransformerBlock", "LadderTransformerBlock"], built
    assert same
