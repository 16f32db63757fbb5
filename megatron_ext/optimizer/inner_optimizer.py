"""The per-element optimizer that updates the fp32 master shards (apex FusedAdam when usable, else torch)."""
from __future__ import annotations

from typing import List

import torch


def build_inner_optimizer(config, param_groups: List[dict]) -> torch.optim.Optimizer:
    """Adam/AdamW (``--optimizer adam``; decoupled decay unless ``decoupled_weight_decay=False``) or SGD."""
    name = getattr(config, "optimizer", "adam")
    lr = config.lr if config.lr is not None else 0.0
    if name == "adam":
        decoupled = getattr(config, "decoupled_weight_decay", True)
        kwargs = dict(lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                      weight_decay=config.weight_decay)
        fused = _apex_fused_adam(param_groups)
        if fused is not None:
            return fused(param_groups, adam_w_mode=decoupled, **kwargs)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(param_groups, foreach=True, **kwargs)
    if name == "sgd":
        return torch.optim.SGD(param_groups, lr=lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay,
                               foreach=True)
    raise ValueError(f"optimizer (--optimizer) must be 'adam' or 'sgd' for the overlapped distributed optimizer, "
                     f"got {name!r}")


def _apex_fused_adam(param_groups: List[dict]):
    on_cuda = any(p.is_cuda for g in param_groups for p in g["params"])
    if not on_cuda:
        return None
    try:
        from apex.optimizers import FusedAdam  # optional dependency
    except Exception:
        return None
    return FusedAdam


def inner_step(inner: torch.optim.Optimizer) -> int:
    """How many steps the optimizer has applied: torch's optimizers count per parameter, apex's FusedAdam per param
    group (and not per parameter)."""
    steps = [s["step"] for s in inner.state.values() if isinstance(s, dict) and "step" in s]
    steps += [g["step"] for g in inner.param_groups if "step" in g]
    return max((int(s.item() if torch.is_tensor(s) else s) for s in steps), default=0)


def set_inner_step(inner: torch.optim.Optimizer, step: int) -> None:
    """After a load, the step count where the optimizer keeps it per param group (apex's FusedAdam: else its bias
    correction would start again at step 1); torch's per-parameter counts are set with the state."""
    if type(inner).__name__ == "FusedAdam":
        for g in inner.param_groups:
            g["step"] = int(step)


def update_rule(inner: torch.optim.Optimizer) -> str:
    """The optimizer's update rule, as checkpoints record it: apex's FusedAdam (what a CUDA host with apex builds)
    is AdamW or Adam by its ``adam_w_mode``, so a state saved with one resumes with the other implementation of the
    same rule (GPU <-> CPU, an imported Megatron state)."""
    name = type(inner).__name__
    if name == "FusedAdam":
        return "AdamW" if getattr(inner, "adam_w_mode", True) else "Adam"
    return name


def same_update_rule(saved: object, inner: torch.optim.Optimizer) -> bool:
    """Whether a checkpoint's ``"optimizer"`` fits ``inner`` (checkpoints written before :func:`update_rule`
    recorded apex's class name, which says Adam or AdamW only through its mode)."""
    rule = update_rule(inner)
    return saved == rule or (saved == "FusedAdam" and rule in ("Adam", "AdamW"))
