"""What the ODO needs to know about megatron-core model parallelism (all optional: plain torch modules work).

- which gradients need a model-parallel all-reduce before the DP reduction (pipeline-tied word embeddings over
  the embedding group, sequence-parallel norms over the TP group). Megatron-core's ``finalize_model_grads`` does
  these on ``param.main_grad`` *after* the DP sync; a design that frees full gradients must do them itself, before
  its reduce-scatter, or they silently never happen (the Megatron-LLaMA pitfall);
- which parameters count towards the global grad norm (TP duplicates and pipeline-shared copies count once);
- the model-parallel group over which norms and inf checks are reduced.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except Exception:  # megatron-core missing or broken: plain torch use
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def model_parallel_grad_reductions(module: torch.nn.Module) -> Dict[int, Tuple[dist.ProcessGroup, bool]]:
    """``{id(param): (group, average)}`` for gradients to all-reduce over a model-parallel group first."""
    ps = _parallel_state()
    if ps is None:
        return {}
    out: Dict[int, Tuple[dist.ProcessGroup, bool]] = {}
    inner = _unwrap(module)
    config = getattr(inner, "config", None)
    tp_group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        sp = bool(getattr(config, "sequence_parallel", False))
        qk = bool(getattr(config, "qk_layernorm", False))
        for name, p in inner.named_parameters():
            if not p.requires_grad:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                out[id(p)] = (tp_group, True)
            elif (sp and getattr(p, "sequence_parallel", False)) or (
                    qk and ("q_layernorm" in name or "k_layernorm" in name)):
                out[id(p)] = (tp_group, False)
    embd = ps.get_embedding_group(check_initialized=False)
    if embd is not None and dist.get_world_size(embd) > 1 and dist.get_rank() in dist.get_process_group_ranks(embd):
        getter = getattr(inner, "shared_embedding_or_output_weight", None)
        share = getattr(inner, "share_embeddings_and_output_weights", False)
        if getter is not None and share and (getattr(inner, "pre_process", False) or getattr(inner, "post_process",
                                                                                            False)):
            w = getter()
            if w is not None and w.requires_grad:
                out[id(w)] = (embd, False)
    return out


def counts_towards_norm(p: torch.nn.Parameter) -> bool:
    """False for TP duplicates on TP rank > 0 and for pipeline-shared copies (counted on their first stage)."""
    ps = _parallel_state()
    if getattr(p, "shared", False):
        return False
    if ps is None:
        return True
    return bool(getattr(p, "tensor_model_parallel", False)) or ps.get_tensor_model_parallel_rank() == 0


def model_parallel_group() -> Optional[dist.ProcessGroup]:
    ps = _parallel_state()
    if ps is None:
        return None
    g = ps.get_model_parallel_group()
    return g if dist.get_world_size(g) > 1 else None
