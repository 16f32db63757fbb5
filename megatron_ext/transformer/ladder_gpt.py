"""GPTModel with a Ladder / Desynced-residual decoder, and conversion of standard checkpoints into it.

megatron-core's ``GPTModel`` hard-codes ``TransformerBlock``; while its constructor runs, that name is bound to a
``LadderTransformerBlock`` factory, so the decoder is built once, in the place (and RNG stream) of the standard
one. Parameter names are unchanged, so a standard checkpoint (state dict) loads as-is: the hybrid model of seed 002
section 4.2 is "same weights, different wiring".
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_model as _gpt_model_module

from .config import LadderConfig
from .ladder_block import LadderTransformerBlock
from .support import check_ladder_supported


class LadderGPTModel(GPTModel):
    """``GPTModel(..., ladder_residual=, ladder_residual_layers=, desync_residual=, ladder_backward_overlap=)``."""

    def __init__(self, *args: Any, ladder_residual: bool = False, ladder_residual_layers: Optional[int] = None,
                 desync_residual: Optional[str] = None, ladder_backward_overlap: bool = True, **kwargs: Any) -> None:
        ladder = LadderConfig(ladder=ladder_residual, ladder_layers=ladder_residual_layers, desync=desync_residual,
                              backward_overlap=ladder_backward_overlap)
        config = kwargs.get("config", args[0] if args else None)
        check_ladder_supported(config, ladder)
        # The decoder is built where GPTModel builds its TransformerBlock, so it draws the same random numbers:
        # with the same seed a ladder model starts from exactly the standard model's weights.
        with _decoder_class(functools.partial(LadderTransformerBlock, ladder=ladder)):
            super().__init__(*args, **kwargs)
        if not isinstance(self.decoder, LadderTransformerBlock):
            raise AssertionError("GPTModel no longer builds its decoder through gpt_model.TransformerBlock")
        self.ladder = ladder


@contextlib.contextmanager
def _decoder_class(factory: Callable[..., torch.nn.Module]) -> Iterator[None]:
    """Bind ``gpt_model.TransformerBlock`` (the name GPTModel.__init__ calls) to ``factory`` for one build."""
    saved = _gpt_model_module.TransformerBlock
    _gpt_model_module.TransformerBlock = factory
    try:
        yield
    finally:
        _gpt_model_module.TransformerBlock = saved


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
