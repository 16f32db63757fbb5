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

from typing import Any, Optional

import torch


def model_config(module: torch.nn.Module) -> Optional[Any]:
    """The ``config`` of the innermost wrapped module (megatron-core's ``get_model_config`` convention)."""
    while getattr(module, "config", None) is None and isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return getattr(module, "config", None)


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
