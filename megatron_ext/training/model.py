"""Build this rank's megatron-core GPTModel stage from pretrain_gpt's flags, wrapped for mixed precision.

The TransformerConfig base (CPU-friendly fusions off, CPU init without CUDA) comes from
``megatron_ext.models.gpt.make_gpt_config``; this file maps Megatron-LM flags onto it. With ``--bf16``/``--fp16``
the model is wrapped in megatron-core's ``Float16Module`` (half params, fp32 logits), as Megatron-LM does, before
the OverlappedDDP wrapper sees it.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: a multiple of ``--make-vocab-size-divisible-by`` x TP, so TP shards are equal."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_config_from_args(args: argparse.Namespace):
    from megatron_ext.models.gpt import make_gpt_config

    return make_gpt_config(args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size,
                           **config_overrides(args))


def _frees_sent_outputs(args: argparse.Namespace) -> bool:
    """Megatron-LM frees a stage's output tensor once it is sent (its autograd graph stays). Only with NCCL: gloo's
    ``isend`` reads the buffer while the schedule goes on, so the interleaved schedule's unbatched sends would carry
    freed (reused) memory; measured here as wrong losses, then NaN, whenever micro-batches outnumber the stages."""
    import torch.distributed as dist

    if dist.is_initialized():   # the group that sends (pretrain_gpt may run inside an existing one)
        return dist.get_backend() == "nccl"
    return (args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "nccl"


def config_overrides(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields these flags set (beyond the shape), as Megatron-LM sets them."""
    import torch.nn.functional as F

    overrides = dict(
        kv_channels=args.kv_channels, num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear, init_method_std=args.init_method_std,
        sequence_parallel=args.sequence_parallel, bf16=args.bf16, fp16=args.fp16,
        params_dtype=args.params_dtype, pipeline_dtype=args.params_dtype,
        use_cpu_initialization=args.use_cpu_initialization or not torch.cuda.is_available(),
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deallocate_pipeline_outputs=_frees_sent_outputs(args),
        # the pipeline split (megatron_ext/training/pipeline_layout.py computes the same map)
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding_in_pipeline_split=getattr(args, "account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=getattr(args, "account_for_loss_in_pipeline_split", False),
    )
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None:
        # Megatron-LM's messages of the interleaved schedule: one send or receive at a time, overlapped with compute,
        # unless --no-overlap-p2p-communication batches them (the plain 1F1B schedule always batches them)
        overrides.update(virtual_pipeline_model_parallel_size=vpp,
                         microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
                         overlap_p2p_comm=args.overlap_p2p_comm, batch_p2p_comm=not args.overlap_p2p_comm)
    if args.swiglu:
        overrides.update(gated_linear_unit=True, activation_func=F.silu)
    if args.squared_relu:
        from megatron.core.activations import squared_relu

        overrides.update(activation_func=squared_relu)
    if args.fp16 or args.bf16 or args.attention_softmax_in_fp32:
        overrides.update(attention_softmax_in_fp32=True)
    if args.qk_layernorm:
        overrides.update(qk_layernorm=True)
    if args.apply_layernorm_1p:
        overrides.update(layernorm_zero_centered_gamma=True)
    if args.init_method_xavier_uniform:   # Megatron-LM: both init methods Xavier-uniform
        overrides.update(init_method=torch.nn.init.xavier_uniform_,
                         output_layer_init_method=torch.nn.init.xavier_uniform_)
    return overrides


def build_model_chunks(args: argparse.Namespace) -> List[torch.nn.Module]:
    """This pipeline stage's model chunks: one, or one per virtual stage with the interleaved pipeline (chunk ``i``
    of stage ``s`` holds layer block ``i * PP + s``, as megatron-core places them)."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return [build_model(args)] if vpp is None else [build_model(args, vp_stage=i) for i in range(vpp)]


def build_model(args: argparse.Namespace, vp_stage: Optional[int] = None) -> torch.nn.Module:
    """This pipeline stage (or its chunk ``vp_stage``) of the GPT, on the current device, Float16Module-wrapped for
    --bf16/--fp16."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.compat import cpu_device_mode, enable_cpu_compat

    enable_cpu_compat()
    config = transformer_config_from_args(args)
    spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
            if args.transformer_impl == "transformer_engine"
            else get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm))
    # With PP > 1 and tied embeddings, megatron-core's LanguageModule moves the shared weight with `.cuda()` before
    # its first/last-stage all-reduce; cpu_device_mode makes that a no-op without CUDA (pass-through with CUDA).
    with cpu_device_mode():
        model = _gpt(GPTModel, config, spec, args, ps, vp_stage)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.fp16 or args.bf16:
        model = Float16Module(config, model)
    return model


def _gpt(GPTModel, config, spec, args: argparse.Namespace, ps, vp_stage: Optional[int]) -> torch.nn.Module:
    extra = {} if vp_stage is None else {"vp_stage": vp_stage}
    if args.ladder_residual or args.desync_residual:
        from megatron_ext.transformer.ladder_gpt import LadderGPTModel

        GPTModel = LadderGPTModel  # noqa: N806 - same constructor plus the ladder options
        extra.update(ladder_residual=args.ladder_residual, ladder_residual_layers=args.ladder_residual_layers,
                      desync_residual=args.desync_residual)
    return GPTModel(**extra,
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage), parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base)
