"""A megatron-core ``TransformerBlock`` whose upper layers use Ladder Residual or Desynced Residual (seed 002).

The layers themselves are megatron-core's ``TransformerLayer`` built from the usual spec (same parameters and
names as a standard model, so standard checkpoints load unchanged); only the wiring between their attention and
MLP submodules changes, which is why this is a block replacement rather than a layer spec.

Ladder (eq. 2, Algorithm 1): with modules m = 0, 1, ... (attention, mlp, attention, ...), module m reads
``norm(r)`` where r = x + out_0 + ... + out_{m-2}; its all-reduce is launched asynchronously and waited only when
out_m is added to the residual, just before module m+2, so it overlaps module m+1. The first module(s) have no
pending output; all pending outputs are added before the final norm / at the end of a pipeline stage.

Desync-nx (section 5): standard wiring, but only the last module of every n keeps its all-reduce; each rank's
residual drifts locally and is re-synchronised by ``AllReduce(out + r / tp)`` at the next reducing module.

Sequence parallelism is rejected: both schemes rely on an all-reduce of a full-sequence partial sum.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from .comm import (PendingOutput, _Slot, launch_ladder_reduce, ladder_add, rendezvous, scale_grad,
                   sum_grad_over_tp, sum_grads_over_tp, sync_all_reduce)
from .config import LadderConfig

# One not-yet-added module output: the pending reduction, the tensor to add, and its gradient slot (or None).
_Pending = Tuple[PendingOutput, Tensor, Optional[_Slot]]


def check_ladder_supported(config) -> None:
    """Raise before anything is built (or any collective launched) for configurations we do not support."""
    if config.sequence_parallel:
        raise ValueError("--ladder-residual/--desync-residual do not support --sequence-parallel: their "
                         "reductions are all-reduces of full-sequence partial sums; drop --sequence-parallel")


class LadderTransformerBlock(TransformerBlock):
    """Drop-in replacement for ``TransformerBlock`` (same constructor plus ``ladder``)."""

    def __init__(self, config, spec, ladder: LadderConfig, pre_process: bool = True, post_process: bool = True,
                 pg_collection=None, vp_stage: Optional[int] = None) -> None:
        check_ladder_supported(config)
        super().__init__(config=config, spec=spec, pre_process=pre_process, post_process=post_process,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.ladder = ladder
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp = ps.get_tensor_model_parallel_world_size()
        if ladder.desync:
            first_global = 0
        else:
            first_global = config.num_layers - ladder.num_ladder_layers(config.num_layers)
        self.first_special = next((i for i, l in enumerate(self.layers) if l.layer_number - 1 >= first_global),
                                  len(self.layers))
        special = list(self.layers)[self.first_special:]
        self.uses_te = any(_is_te(l.self_attention.linear_proj) for l in special)
        if self.uses_te and ladder.desync and self.tp > 1:
            raise NotImplementedError("--desync-residual needs the local layer spec: transformer-engine fuses the "
                                      "norm into linear_qkv, so the per-rank norm gradients cannot be summed")
        # Residual gradients are per-rank partial sums inside the special region (see comm.py notes). With TE
        # the ladder keeps megatron's own input-gradient all-reduces (no backward overlap), for the same reason.
        self.partial_grads = (self.tp > 1 and bool(special) and not self.uses_te
                              and (bool(ladder.desync) or ladder.backward_overlap))
        for layer in special:
            self._rewire(layer)

    def _rewire(self, layer) -> None:
        """Row-parallel linears return partial sums (we reduce); column-parallel ones skip input-grad reduction
        when residual gradients are kept partial."""
        attn, mlp = layer.self_attention, layer.mlp
        for name, mod in (("linear_proj", attn.linear_proj), ("linear_fc2", mlp.linear_fc2)):
            if _is_te(mod):
                # [untested here: no TE on CPU] TE reduces inside te.pytorch.Linear when parallel_mode == "row";
                # None gives the partial output, as megatron's own explicit_expert_comm path does.
                if not getattr(mod, "te_return_bias", False):
                    raise NotImplementedError(f"{name}: TE linear must return its bias separately")
                mod.parallel_mode = None
                continue
            if not isinstance(mod, RowParallelLinear) or not mod.skip_bias_add:
                raise NotImplementedError(
                    f"ladder/desync blocks need megatron-core's RowParallelLinear with skip_bias_add for {name}; "
                    f"got {type(mod).__name__} (use the local layer spec)")
            mod.explicit_expert_comm = True  # megatron's own switch for "return output_parallel, no all-reduce"
        if self.partial_grads:
            for name, mod in (("linear_qkv", attn.linear_qkv), ("linear_fc1", mlp.linear_fc1)):
                if not isinstance(mod, ColumnParallelLinear):
                    raise NotImplementedError(f"{name} is {type(mod).__name__}; the local layer spec is required")
                mod.disable_grad_reduce = True
                mod.allreduce_dgrad = False
            for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                if not isinstance(norm, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                    raise NotImplementedError(f"norm {type(norm).__name__} is not supported with TP>1 here")

    # ---- forward -------------------------------------------------------------------------------------------

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor], context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, inference_context=None, packed_seq_params=None, sequence_len_offset=None,
                padding_mask=None, **unused: Any) -> Tensor:
        if inference_context is not None or unused.get("inference_params") is not None:
            raise NotImplementedError("ladder/desync blocks do not support megatron inference contexts yet")
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        kw = dict(attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                  rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                  sequence_len_offset=sequence_len_offset)
        segments = self._segments()
        standard = [seg for seg in segments if not seg[2]]
        for layers, ckpt, _ in standard:
            hidden_states = self._maybe_checkpoint(ckpt, self._standard_chunk(layers, kw), hidden_states)
        special = [seg for seg in segments if seg[2]]
        if special:
            hidden_states = self._special_forward(special, hidden_states, kw)

        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and not self.final_layernorm:
            hidden_states = hidden_states.clone()
        return hidden_states

    def _segments(self) -> List[Tuple[List, bool, bool]]:
        """Split this stage's layers into (layers, checkpointed, special) runs following megatron's full
        recompute options: 'uniform' checkpoints every chunk of recompute_num_layers, 'block' only the first
        recompute_num_layers layers. Standard and ladder/desync layers never share a segment."""
        layers = list(self.layers)
        full = self.config.recompute_granularity == "full" and self.training
        n = max(1, self.config.recompute_num_layers or 1)
        block = self.config.recompute_method == "block"
        segments: List[Tuple[List, bool, bool]] = []
        for special, part in ((False, layers[: self.first_special]), (True, layers[self.first_special:])):
            offset = 0 if not special else self.first_special
            i = 0
            while i < len(part):
                if not full:
                    size, ckpt = len(part), False
                elif block:
                    done = offset + i
                    size = max(1, n - done) if done < n else len(part) - i
                    ckpt = done < n
                else:
                    size, ckpt = n, True
                segments.append((part[i:i + size], ckpt, special))
                i += size
        return segments

    @staticmethod
    def _maybe_checkpoint(recompute: bool, fn: Callable, *args: Tensor):
        if recompute:
            return tensor_parallel.checkpoint(fn, False, *args)
        return fn(*args)

    def _standard_chunk(self, layers: List, kw: dict) -> Callable:
        def run(h: Tensor) -> Tensor:
            for layer in layers:
                h, _ = layer(hidden_states=h, **kw)
            return h
        return run

    def _special_forward(self, segments: List[Tuple[List, bool, bool]], r: Tensor, kw: dict) -> Tensor:
        if self.partial_grads:
            r = sum_grad_over_tp(r, self.tp_group)  # leaving the region, gradients become full again
        if self.ladder.desync:
            for layers, ckpt, _ in segments:
                r = self._maybe_checkpoint(ckpt, self._desync_chunk(layers, kw), r)
            # stage/block end: re-synchronise the residual before the final norm / next stage
            if not self.ladder.reduces(2 * segments[-1][0][-1].layer_number - 1):
                r = sync_all_reduce(r / self.tp, self.tp_group)
        else:
            pending: List[Tensor] = []
            for i, (layers, ckpt, _) in enumerate(segments):
                last = i == len(segments) - 1
                outs = self._maybe_checkpoint(ckpt, self._ladder_chunk(layers, kw, last), r, *pending)
                r, pending = outs[0], list(outs[1:])
        if self.partial_grads:
            r = scale_grad(r, 1.0 / self.tp)  # incoming gradient is replicated; enter partial form
        return r

    # ---- ladder --------------------------------------------------------------------------------------------

    def _ladder_chunk(self, layers: List, kw: dict, last: bool) -> Callable:
        """Run ``layers`` with ladder wiring. Inputs: residual and up to two finished outputs from before the
        chunk. The last chunk flushes (adds every pending output: before the final norm / at the stage end);
        others return the residual and their last two outputs, finished (waited) but not yet added, so that a
        recomputed chunk is a pure function of its inputs."""
        def run(r: Tensor, *carried: Tensor):
            queue: Deque[_Pending] = deque()
            for t in carried:
                queue.append((None, self._carried(t), None))
            n_modules = 2 * len(layers)
            m = 0
            for layer in layers:
                for norm, fn in ((layer.input_layernorm, lambda x, l=layer: l.self_attention(x, **_attn_kw(kw))),
                                 (layer.pre_mlp_layernorm, lambda x, l=layer: l.mlp(x))):
                    if len(queue) == 2:
                        r = self._add_pending(r, queue.popleft())
                    out, bias = fn(self._norm(norm, r))
                    tag = 2 * (layer.layer_number - 1) + m % 2  # global module index
                    p = launch_ladder_reduce(out, bias, self.tp_group, self.config.hidden_dropout, self.training,
                                             tag)
                    t, slot = p.tensor, None
                    # Outputs that leave a recompute chunk are reduced in backward by the consumer instead.
                    crosses = not last and m >= n_modules - 2
                    if self.partial_grads and not crosses:
                        t, slot = rendezvous(t, tag)
                    queue.append((p, t, slot))
                    m += 1
            if last:
                while queue:
                    r = self._add_pending(r, queue.popleft())
                return (r,)
            return (r, *[self._finish(q) for q in queue])
        return run

    def _carried(self, t: Tensor) -> Tensor:
        return sum_grad_over_tp(t, self.tp_group) if self.partial_grads else t

    def _add_pending(self, r: Tensor, item: _Pending) -> Tensor:
        p, t, slot = item
        if p is not None:
            p.wait()
        return ladder_add(r, t, slot, self.tp_group) if slot is not None else r + t

    @staticmethod
    def _finish(item: _Pending) -> Tensor:
        p, t, slot = item
        if p is not None:
            p.wait()
        if slot is not None:
            raise AssertionError("outputs leaving a chunk must not hold a gradient slot")
        return t

    # ---- desync --------------------------------------------------------------------------------------------

    def _desync_chunk(self, layers: List, kw: dict) -> Callable:
        def run(r: Tensor) -> Tensor:
            for layer in layers:
                base = 2 * (layer.layer_number - 1)
                for j, (norm, fn) in enumerate(
                        ((layer.input_layernorm, lambda x, l=layer: l.self_attention(x, **_attn_kw(kw))),
                         (layer.pre_mlp_layernorm, lambda x, l=layer: l.mlp(x)))):
                    out, bias = fn(self._norm(norm, r))
                    out = F.dropout(out, p=self.config.hidden_dropout, training=self.training)
                    bias = sum_grad_over_tp(bias, self.tp_group) if self.partial_grads else bias
                    if self.ladder.reduces(base + j):
                        r = sync_all_reduce(out + r / self.tp, self.tp_group)
                    else:
                        r = r + out
                    if bias is not None:
                        r = r + bias
            return r
        return run

    # ---- helpers -------------------------------------------------------------------------------------------

    def _norm(self, norm: torch.nn.Module, x: Tensor) -> Tensor:
        if not self.partial_grads:
            return norm(x)
        w, b = sum_grads_over_tp([norm.weight, getattr(norm, "bias", None)], self.tp_group)
        if isinstance(norm, torch.nn.LayerNorm):
            return F.layer_norm(x, norm.normalized_shape, w, b, norm.eps)
        return F.rms_norm(x, norm.normalized_shape, w, norm.eps)


def _is_te(mod: torch.nn.Module) -> bool:
    return type(mod).__module__.startswith("megatron.core.extensions.transformer_engine")


def _attn_kw(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if v is not None or k == "attention_mask"}
