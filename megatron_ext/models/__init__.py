"""megatron-core model builders that run on CPU (gloo) and GPU alike."""
from __future__ import annotations

from .gpt import build_gpt_model, gpt_forward_step, gpt_loss_func, make_gpt_config, synthetic_gpt_batch

__all__ = ["build_gpt_model", "make_gpt_config", "gpt_forward_step", "gpt_loss_func", "synthetic_gpt_batch"]
