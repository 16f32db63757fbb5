"""What the ladder/desync block accepts and refuses: TE row linears with and without bias, norm modules other
than torch's (apex/megatron FusedLayerNorm style) at TP>1, and config options it cannot honour."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from unit_tests.test_utilities import Utils
from unit_tests.transformer.equivalence import errors_against_reference, full_params

from megatron_ext.transformer.support import check_ladder_supported, check_te_row_linear, is_te, norm_parameters

SHAPE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=8)


def _te_linear(use_bias: bool, te_return_bias: bool) -> torch.nn.Module:
    """Stand-in for megatron's TERowParallelLinear: the two attributes megatron sets (TE is not installed)."""
    cls = type("TERowParallelLinear", (torch.nn.Module,), {"__module__": "megatron.core.extensions.transformer_engine"})
    mod = cls()
    mod.use_bias, mod.te_return_bias = use_bias, te_return_bias  # megatron: te_return_bias = skip_bias_add and bias
    return mod


def test_te_row_linear_is_refused_only_when_it_adds_a_bias_itself():
    assert is_te(_te_linear(False, False))
    check_te_row_linear(_te_linear(use_bias=False, te_return_bias=False), "linear_proj")  # add_bias_linear=False
    check_te_row_linear(_te_linear(use_bias=True, te_return_bias=True), "linear_proj")  # skip_bias_add
    with pytest.raises(NotImplementedError, match="linear_fc2: transformer-engine linear adds its bias"):
        check_te_row_linear(_te_linear(use_bias=True, te_return_bias=False), "linear_fc2")


class FusedStyleLayerNorm(torch.nn.Module):
    """apex/megatron ``FusedLayerNorm`` stand-in: constructed from the config, reads ``self.weight``/``self.bias``
    in its own forward (not a torch.nn.LayerNorm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def test_norm_with_other_parameters_is_refused_with_the_workaround():
    norm = FusedStyleLayerNorm(None, 4)
    assert norm_parameters(norm) == [norm.weight, norm.bias]
    norm.scale = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(NotImplementedError, match="ladder_backward_overlap=False"):
        norm_parameters(norm)


def test_config_options_the_block_cannot_honour_are_refused_by_flag():
    base = dict(sequence_parallel=False, num_moe_experts=None, apply_residual_connection_post_layernorm=False,
                recompute_granularity=None, recompute_modules=["core_attn"], tensor_model_parallel_size=2,
                distribute_saved_activations=False)
    check_ladder_supported(SimpleNamespace(**base))
    for override, flag in ((dict(num_moe_experts=8), "--num-experts"),
                           (dict(apply_residual_connection_post_layernorm=True), "post-layernorm"),
                           (dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
                            "--recompute-modules")):
        with pytest.raises(ValueError, match=flag):
            check_ladder_supported(SimpleNamespace(**{**base, **override}))


def _fused_style_norm_at_tp2():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.compat import cpu_device_mode
    from megatron_ext.models import synthetic_gpt_batch
    from megatron_ext.models.gpt import make_gpt_config
    from megatron_ext.transformer import LadderGPTModel

    full = full_params(SHAPE)
    Utils.initialize_model_parallel(2, 1)
    try:
        spec = get_gpt_layer_local_spec()
        spec.submodules.input_layernorm = FusedStyleLayerNorm
        spec.submodules.pre_mlp_layernorm = FusedStyleLayerNorm
        b = synthetic_gpt_batch(2, SHAPE["seq_length"], SHAPE["vocab_size"], seed=3)
        out = {}
        for name, kw, wiring in (("ladder", dict(ladder_residual=True), dict(ladder_layers=3)),
                                 ("desync2x", dict(desync_residual="2x"), dict(desync="2x", k=2))):
            config = make_gpt_config(SHAPE["num_layers"], SHAPE["hidden_size"], SHAPE["num_attention_heads"],
                                     SHAPE["ffn_hidden_size"])
            with cpu_device_mode():
                model = LadderGPTModel(config=config, transformer_layer_spec=spec, vocab_size=SHAPE["vocab_size"],
                                       max_sequence_length=SHAPE["seq_length"], parallel_output=True,
                                       position_embedding_type="learned_absolute", **kw)
            assert type(model.decoder.layers[0].input_layernorm) is FusedStyleLayerNorm
            out[name] = errors_against_reference(model, full, SHAPE, wiring, b)
        return out
    finally:
        Utils.destroy_model_parallel()


def test_fused_style_norm_at_tp2_equals_the_reference(spawn):
    for rank in spawn(_fused_style_norm_at_tp2, 2):
        for name, (loss_err, grad_err, _) in rank.items():
            assert loss_err < 1e-5 and grad_err < 1e-5, (name, loss_err, grad_err)
