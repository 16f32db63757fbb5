"""Build a megatron-core GPTModel from plain arguments, plus the forward-step/loss pair its schedules need.

Used by tests, benchmarks and ``pretrain_gpt``. Parallelism (TP/PP) comes from megatron-core's ``parallel_state``,
which the caller initialises; on a machine without CUDA the CPU compat shims are enabled here.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from megatron_ext.compat import causal_attention_mask, cpu_device_mode, enable_cpu_compat


def make_gpt_config(num_layers: int, hidden_size: int, num_attention_heads: int, ffn_hidden_size: Optional[int] = None,
                    **overrides: Any):
    """A TransformerConfig for CPU-friendly runs: fp32, no dropout, CPU init (identical weights across TP sizes).

    ``overrides`` are TransformerConfig fields (e.g. ``sequence_parallel``, ``bf16``, ``recompute_granularity``).
    TP/PP sizes default to parallel_state's.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: Dict[str, Any] = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int, seq_length: int,
                    ffn_hidden_size: Optional[int] = None, *, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, position_embedding_type: str = "learned_absolute",
                    share_embeddings_and_output_weights: bool = False, layer_spec: str = "local",
                    ladder_residual: bool = False, ladder_residual_layers: Optional[int] = None,
                    desync_residual: Optional[str] = None, ladder_backward_overlap: bool = True, config: Any = None,
                    **config_overrides: Any):
    """Build a megatron-core GPTModel for this rank's pipeline stage.

    ``layer_spec``: "local" (torch modules) or "te" (transformer-engine; requires TE importable).
    ``ladder_residual`` / ``ladder_residual_layers`` / ``desync_residual`` ("2x" | "4x") swap the decoder for a
    Ladder / Desynced-residual block (megatron_ext.transformer); with all three at their defaults the model is
    megatron-core's own GPTModel, unchanged. ``ladder_backward_overlap=False`` keeps megatron's own input-grad
    all-reduces (no backward overlap; for comparison).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    enable_cpu_compat()
    if config is None:
        config = make_gpt_config(num_layers, hidden_size, num_attention_heads, ffn_hidden_size, **config_overrides)
    spec = _layer_spec(layer_spec)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    kwargs = dict(config=config, transformer_layer_spec=spec, vocab_size=vocab_size, max_sequence_length=seq_length,
                  pre_process=pre_process, post_process=post_process, parallel_output=True,
                  share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                  position_embedding_type=position_embedding_type)
    # Pipeline-tied embeddings call ``weight.data.cuda()`` at construction: build under the CPU device mode.
    with cpu_device_mode():
        if ladder_residual or desync_residual:
            from megatron_ext.transformer.ladder_gpt import LadderGPTModel
            return LadderGPTModel(**kwargs, ladder_residual=ladder_residual,
                                  ladder_residual_layers=ladder_residual_layers, desync_residual=desync_residual,
                              ladder_backward_overlap=ladder_backward_overlap)
        return GPTModel(**kwargs)


def _layer_spec(name: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if name == "local":
        return get_gpt_layer_local_spec()
    if name == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise ValueError("layer_spec='te' needs transformer-engine importable; use layer_spec='local'") from e
        return get_gpt_layer_with_transformer_engine_spec()
    raise ValueError(f"layer_spec must be 'local' or 'te', got {name!r}")


# ---- data and the forward step the schedules call ------------------------------------------------------------


def synthetic_gpt_batch(micro_batch_size: int, seq_length: int, vocab_size: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A deterministic batch (same on every rank for a given seed): next-token prediction on random tokens."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=g)
    return {
        "tokens": data[:, :-1].contiguous(),
        "labels": data[:, 1:].contiguous(),
        "loss_mask": torch.ones(micro_batch_size, seq_length),
        "position_ids": torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1).contiguous(),
        "attention_mask": causal_attention_mask(seq_length),
    }


def gpt_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Mean token loss over the micro-batch (loss_mask weighted); returns ``(loss, {"lm loss": loss})``."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def gpt_forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model: torch.nn.Module
                     ) -> Tuple[torch.Tensor, Callable]:
    """``forward_step_func`` for megatron-core's ``get_forward_backward_func``: batch dicts as from
    :func:`synthetic_gpt_batch` (tokens, labels, loss_mask, position_ids, attention_mask)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(gpt_loss_func, batch["loss_mask"])
