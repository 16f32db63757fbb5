"""Compare a (possibly TP-sharded) megatron model's losses and gradients with the hand-written reference."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from unit_tests.test_utilities import Utils
from unit_tests.transformer import ladder_reference as ref


def full_params(shape: dict, seed: int = 7) -> Dict[str, torch.Tensor]:
    """TP=1 megatron weights plus noise (so biases are non-zero and the bias-once rule is tested)."""
    from megatron_ext.models import build_gpt_model
    from megatron_ext.models.weights import full_parameters

    Utils.initialize_model_parallel(1, 1)
    try:
        full = full_parameters(build_gpt_model(**shape))
    finally:
        Utils.destroy_model_parallel()
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in full.items()}


def errors_against_reference(model: torch.nn.Module, full: Dict[str, torch.Tensor], shape: dict, wiring: dict,
                             batch: dict) -> Tuple[float, float, float]:
    """Load ``full`` into ``model``, run forward+backward in training mode and the reference on the same batch;
    return (max loss error, max gradient error over this rank's shards, reference mean loss)."""
    from megatron_ext.models.weights import global_name, load_full_state_dict, shard_of

    load_full_state_dict(model, full)
    model.train()
    losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    losses.mean().backward()
    params = {n: t.clone().requires_grad_() for n, t in full.items()}
    expected = ref.gpt_losses(params, batch["tokens"], batch["labels"], shape["num_layers"],
                              shape["num_attention_heads"], **wiring)
    expected.mean().backward()
    loss_err = (losses.detach() - expected.detach()).abs().max().item()
    grad_err = max((p.grad - shard_of(model, n, params[global_name(model, n)].grad)).abs().max().item()
                   for n, p in model.named_parameters())
    return loss_err, grad_err, expected.mean().item()
