"""Move weights between a full (TP=1, PP=1) model and this rank's TP/PP shard of the same architecture.

Tests use it to give a TP=2 x PP=2 model exactly the weights of a single-process model; the ladder conversion
uses it because a ladder model has the same parameter names as a standard one (only the wiring differs).
Column/row-parallel and vocab-parallel weights are sliced along their ``partition_dim``; fused SwiGLU fc1
weights (two halves sharded separately) are handled by slicing each half.
"""
from __future__ import annotations

import re
from typing import Dict

import torch

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def global_name(model: torch.nn.Module, name: str) -> str:
    """Map a stage-local ``decoder.layers.<j>`` index to the global layer index (``layer_number - 1``)."""
    m = _LAYER.match(name)
    if m is None:
        return name
    decoder = _find_decoder(model)
    j = int(m.group(2))
    return f"{m.group(1)}{decoder.layers[j].layer_number - 1}{m.group(3)}"


def _find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model.decoder


def _shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int, swiglu_name: bool) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if swiglu_name and dim == 0:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def load_full_state_dict(model: torch.nn.Module, full: Dict[str, torch.Tensor], swiglu: bool = False) -> None:
    """Copy ``full`` (parameter name -> unsharded tensor, global layer numbering) into this rank's shard."""
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = global_name(model, name)
            if key not in full:
                raise KeyError(f"{key} (local {name}) missing from the full state dict")
            src = _shard(full[key], p, tp_rank, tp_size, swiglu and "linear_fc1" in name)
            if src.shape != p.shape:
                raise ValueError(f"{name}: shard {tuple(src.shape)} does not fit parameter {tuple(p.shape)}")
            p.copy_(src)


def full_parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Parameter name (global layer numbering) -> detached clone, for a TP=1 model (the reference)."""
    return {global_name(model, n): p.detach().clone() for n, p in model.named_parameters()}


def shard_of(model: torch.nn.Module, name: str, full: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """This rank's slice of ``full`` for the parameter ``name`` of ``model`` (e.g. to compare gradients)."""
    from megatron.core import parallel_state as ps

    p = dict(model.named_parameters())[name]
    return _shard(full, p, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                  swiglu and "linear_fc1" in name)
