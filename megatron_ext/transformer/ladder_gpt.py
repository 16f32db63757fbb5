"""GPTModel with a Ladder / Desynced-residual decoder, and conversion of standard checkpoints into it.

megatron-core's ``GPTModel`` hard-codes ``TransformerBlock``; we build the standard model and swap its decoder for
a ``LadderTransformerBlock`` built from the same spec. Parameter names are unchanged, so a standard checkpoint
(state dict) loads as-is: the hybrid model of seed 002 section 4.2 is "same weights, different wiring".
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from megatron.core.models.gpt import GPTModel

from .config import LadderConfig
from .ladder_block import LadderTransformerBlock, check_ladder_supported


class LadderGPTModel(GPTModel):
    """``GPTModel(..., ladder_residual=, ladder_residual_layers=, desync_residual=, ladder_backward_overlap=)``."""

    def __init__(self, *args: Any, ladder_residual: bool = False, ladder_residual_layers: Optional[int] = None,
                 desync_residual: Optional[str] = None, ladder_backward_overlap: bool = True, **kwargs: Any) -> None:
        ladder = LadderConfig(ladder=ladder_residual, ladder_layers=ladder_residual_layers, desync=desync_residual,
                              backward_overlap=ladder_backward_overlap)
        config = kwargs.get("config", args[0] if args else None)
        check_ladder_supported(config)
        super().__init__(*args, **kwargs)
        spec = kwargs.get("transformer_layer_spec", args[1] if len(args) > 1 else None)
        # Rebuild the decoder under the same RNG stream a standard build would use for it, so that with
        # use_cpu_initialization a ladder model starts from exactly the standard model's weights.
        old = self.decoder
        self.decoder = LadderTransformerBlock(config=self.config, spec=spec, ladder=ladder,
                                              pre_process=self.pre_process, post_process=self.post_process,
                                              pg_collection=getattr(self, "pg_collection", None),
                                              vp_stage=getattr(self, "vp_stage", None))
        self.decoder.load_state_dict(old.state_dict())
        self.ladder = ladder


def convert_standard_to_ladder(standard_state_dict: Dict[str, Any], model: torch.nn.Module,
                               strict: bool = True) -> torch.nn.Module:
    """Load a standard GPTModel state dict into a ladder/hybrid model (same parameter names and shapes)."""
    missing, unexpected = model.load_state_dict(standard_state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise KeyError(f"standard checkpoint does not match the ladder model: missing={missing} "
                       f"unexpected={unexpected}")
    return model
