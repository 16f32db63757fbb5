"""Ladder Residual and Desynced Residual for megatron-core GPT models (seed 002).

Build a model with ``megatron_ext.models.build_gpt_model(..., ladder_residual=True, ladder_residual_layers=N,
desync_residual="2x"|"4x")``. Files: ladder_block.py (the wiring, incl. inference contexts), comm.py (autograd
functions for the reductions), recompute_plan.py (megatron's full-recompute grouping), support.py (what is
refused, and why), ladder_gpt.py (the GPTModel and standard-checkpoint conversion), config.py (flags).
"""
from __future__ import annotations

from .config import LadderConfig

__all__ = ["LadderConfig", "LadderTransformerBlock", "LadderGPTModel", "convert_standard_to_ladder"]


def __getattr__(name: str):
    # Lazy: importing megatron-core is slow and not needed for LadderConfig (flag validation).
    if name == "LadderTransformerBlock":
        from .ladder_block import LadderTransformerBlock
        return LadderTransformerBlock
    if name in ("LadderGPTModel", "convert_standard_to_ladder"):
        from . import ladder_gpt
        return getattr(ladder_gpt, name)
    raise AttributeError(name)
