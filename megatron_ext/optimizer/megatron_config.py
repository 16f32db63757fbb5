"""What the ODO reads from a wrapped megatron-core model's TransformerConfig (plain torch modules have none).

- ``calculate_per_token_loss``: megatron-core's DDP then *sums* gradients over the DP group (gradient scaling
  factor 1.0) and ``finalize_model_grads`` divides by the global token count through ``scale_gradients``. The ODO's
  backends always average, so the wrapper asks the gradient path to multiply by the DP size once per collective.
- ``gradient_accumulation_fusion``: megatron's fused weight-gradient GEMM writes into ``param.main_grad`` and
  hands autograd a dummy gradient. The ODO keeps no per-parameter ``main_grad`` (gradients live in pooled bucket
  buffers that exist only while a bucket fills), so the fused path would fail inside backward, after collectives
  have started; it is refused at wrap time instead.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch


def model_config(module: torch.nn.Module) -> Optional[Any]:
    """The ``config`` of the innermost wrapped module (megatron-core's ``get_model_config`` convention)."""
    while getattr(module, "config", None) is None and isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return getattr(module, "config", None)


def attach_to_schedules(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], optimizer: Any) -> Any:
    """Point the model config's schedule hooks at the wrapper(s) and optimizer, as Megatron-LM's ``train()`` does:
    ``no_sync_func`` (no reduction for all but the last micro-batch; one per chunk of an interleaved pipeline,
    whose schedule lifts it chunk by chunk, each before its last backward), ``finalize_model_grads_func``
    (megatron-core's, which calls each wrapper's ``finish_grad_sync``) and ``grad_scale_func`` (the loss scale).
    Set on every chunk's config (megatron-core's schedules read the first chunk's); returns the first's."""
    from megatron.core.distributed import finalize_model_grads

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    configs = [model_config(c) for c in chunks]
    if any(config is None for config in configs):
        raise ValueError("model wraps no module with a megatron-core config: the schedules need one")
    for config in configs:
        config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
    return configs[0]


def per_token_loss(module: torch.nn.Module) -> bool:
    return bool(getattr(model_config(module), "calculate_per_token_loss", False))


def check_supported(module: torch.nn.Module) -> None:
    """Refuse TransformerConfig settings the ODO cannot honour (called before any collective)."""
    config = model_config(module)
    if bool(getattr(config, "gradient_accumulation_fusion", False)):
        raise ValueError(
            "--gradient-accumulation-fusion (TransformerConfig.gradient_accumulation_fusion=True) is not supported "
            "by the OverlappedDistributedOptimizer: the fused wgrad GEMM accumulates into param.main_grad, which "
            "the ODO does not keep. Pass --no-gradient-accumulation-fusion (gradient_accumulation_fusion=False).")
