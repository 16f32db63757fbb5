"""What a Ladder/Desync block can run, checked before anything is built or any collective starts.

Each refusal names the flag (or module) at fault and what to use instead.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from .config import LadderConfig

_TE_MODULE = "megatron.core.extensions.transformer_engine"


def check_ladder_supported(config: Any, ladder: Optional[LadderConfig] = None) -> None:
    """Config-level checks (TransformerConfig fields); raise ValueError naming the megatron flag."""
    if config.sequence_parallel:
        raise ValueError("--ladder-residual/--desync-residual do not support --sequence-parallel: their "
                         "reductions are all-reduces of full-sequence partial sums; drop --sequence-parallel")
    if getattr(config, "num_moe_experts", None):
        raise ValueError("--ladder-residual/--desync-residual support dense MLPs only: MoE layers dispatch tokens "
                         "with their own collectives and have no single row-parallel output to reduce; drop "
                         "--num-experts")
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise ValueError("--apply-residual-connection-post-layernorm is not supported by ladder/desync layers "
                         "(they implement the pre-norm residual of seed 002 eq. 2)")
    if config.recompute_granularity == "selective":
        extra = sorted(set(config.recompute_modules or []) - {"core_attn"})
        if extra:
            raise ValueError(f"--recompute-modules {extra} are not supported by ladder/desync layers (they call "
                             "the norms and MLP themselves); only core_attn can be recomputed selectively")
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if ladder is not None and ladder.desync and tp > 1 and getattr(config, "distribute_saved_activations", False):
        raise ValueError("--distribute-saved-activations cannot be used with --desync-residual at TP>1: a "
                         "desynced residual differs between TP ranks at recompute boundaries, so it cannot be "
                         "split across them and gathered back; drop --distribute-saved-activations")


def is_te(mod: torch.nn.Module) -> bool:
    return type(mod).__module__.startswith(_TE_MODULE)


def check_te_row_linear(mod: torch.nn.Module, name: str) -> None:
    """A TE row-parallel linear may be switched to return its partial sum only if it does not add a bias
    itself: a bias added inside the module would be added to every rank's partial sum, i.e. TP times."""
    adds_bias = bool(getattr(mod, "use_bias", False)) and not getattr(mod, "te_return_bias", False)
    if adds_bias:
        raise NotImplementedError(f"{name}: transformer-engine linear adds its bias internally; ladder/desync need "
                                  "it returned separately (megatron does so when skip_bias_add is set)")


def norm_parameters(norm: torch.nn.Module) -> List[Optional[torch.nn.Parameter]]:
    """``[weight, bias]`` of a norm whose only parameters are those two plain attributes (bias may be None).

    At TP>1 the block keeps residual gradients as per-rank partial sums, so it must substitute the norm's
    parameters by views whose gradients it sums over TP (once per layer, after its backward). That works for any
    norm module (torch, apex/megatron FusedLayerNorm, ...) as long as it reads exactly ``self.weight`` and
    ``self.bias``; anything else would leave a gradient unsummed, so it is refused.
    """
    params = dict(norm.named_parameters())
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    ok = (isinstance(weight, torch.nn.Parameter) and (bias is None or isinstance(bias, torch.nn.Parameter))
          and set(params) == {"weight"} | ({"bias"} if bias is not None else set()))
    if not ok:
        raise NotImplementedError(
            f"norm {type(norm).__name__} has parameters {sorted(params)}; ladder (with backward overlap) and "
            "desync at TP>1 need a norm whose parameters are exactly `weight` (and `bias`). For ladder, "
            "ladder_backward_overlap=False keeps megatron's own gradient all-reduces and any norm works")
    return [weight, bias]
