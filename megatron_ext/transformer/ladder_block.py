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

Inference: megatron's ``inference_context`` (KV cache), rotary and ``sequence_len_offset`` arguments reach the
attention modules exactly as ``TransformerLayer`` passes them, so prefill + decode steps work unchanged.

[Note: deferred parameter gradients]  At TP>1 with partial residual gradients (see comm.py), the norm weights
(and, for desync, the row-parallel biases) receive per-rank partial gradients. Instead of one blocking all-reduce
per module, each layer routes its own such parameters through ONE identity node, created when the layer runs
(after the pending add that precedes its first module); its backward sums them over TP in one coalesced
all-reduce as soon as the layer's backward is done. So, with the ODO, a layer's norm weights are read (their
all-gather waited) only when that layer runs, and their gradients reach their buckets right after that layer's
backward instead of holding back every later bucket until the whole block is done. The first ladder/desync
layer's node also carries the block input, whose gradient leaves the partial region there. In backward each
node runs before the async reduction launched by that pending add, which thus still overlaps the backward of the
module below instead of being waited for by a blocking all-reduce queued behind it. Gradient hooks
(DDP, the optimizer) see only the summed gradient. Inside a recompute chunk the node is created again when the
chunk is recomputed, and its backward runs within the chunk's backward.

Sequence parallelism is rejected: both schemes rely on an all-reduce of a full-sequence partial sum.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import WrappedTensor, deprecate_inference_params, make_viewless_tensor

from .comm import (PendingOutput, _Slot, launch_ladder_reduce, ladder_add, rendezvous, scale_grad,
                   sum_grad_over_tp, sum_grads_over_tp, sync_all_reduce)
from .config import LadderConfig
from .recompute_plan import Segment, plan_segments
from .support import check_ladder_supported, check_te_row_linear, is_te, norm_parameters

# One not-yet-added module output: the pending reduction, the tensor to add, and its gradient slot (or None).
_Pending = Tuple[PendingOutput, Tensor, Optional[_Slot]]
# A partial-gradient parameter of one layer, as (owning module, attribute name): read when the layer runs.
_ParamSlot = Tuple[torch.nn.Module, str]
# (id(owning module), attribute name) -> the view whose gradient the layer's node sums over TP; None: no node.
_Subst = Optional[Dict[Tuple[int, str], Tensor]]


class LadderTransformerBlock(TransformerBlock):
    """Drop-in replacement for ``TransformerBlock`` (same constructor plus ``ladder``)."""

    def __init__(self, config, spec, ladder: LadderConfig, pre_process: bool = True, post_process: bool = True,
                 pg_collection=None, vp_stage: Optional[int] = None) -> None:
        check_ladder_supported(config, ladder)
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
        self.uses_te = any(is_te(l.self_attention.linear_proj) for l in special)
        if self.uses_te and ladder.desync and self.tp > 1:
            raise NotImplementedError("--desync-residual needs the local layer spec at TP>1: transformer-engine "
                                      "fuses the norm into linear_qkv, so the per-rank norm gradients cannot be "
                                      "summed; use --transformer-impl local")
        # Residual gradients are per-rank partial sums inside the special region (see comm.py notes). With TE
        # the ladder keeps megatron's own input-gradient all-reduces (no backward overlap), for the same reason.
        self.partial_grads = (self.tp > 1 and bool(special) and not self.uses_te
                              and (bool(ladder.desync) or ladder.backward_overlap))
        # Per layer of this stage (empty for standard layers): where its partial-gradient parameters live.
        self._param_slots: List[Tuple[_ParamSlot, ...]] = [() for _ in range(self.first_special)]
        for layer in special:
            self._rewire(layer)
            self._param_slots.append(self._partial_grad_slots(layer) if self.partial_grads else ())

    def _rewire(self, layer) -> None:
        """Row-parallel linears return partial sums (we reduce); column-parallel ones skip input-grad reduction
        when residual gradients are kept partial."""
        if not isinstance(layer.cross_attention, IdentityOp):
            raise NotImplementedError("ladder/desync layers have no cross-attention; use a spec without it")
        attn, mlp = layer.self_attention, layer.mlp
        for name, mod in (("linear_proj", attn.linear_proj), ("linear_fc2", mlp.linear_fc2)):
            if is_te(mod):
                # [untested here: no TE on CPU] TE reduces inside te.pytorch.Linear when parallel_mode == "row";
                # None gives the partial output, as megatron's own explicit_expert_comm path does.
                check_te_row_linear(mod, name)
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

    def _partial_grad_slots(self, layer) -> Tuple[_ParamSlot, ...]:
        """Where one layer's parameters with per-rank partial gradients live (module note). Validated once, here;
        the parameters themselves are read when the layer runs, so replaced parameters are the ones summed."""
        slots: List[_ParamSlot] = []
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            _, bias = norm_parameters(norm)  # refuse norms whose gradients the layer's node could not all reach
            slots += [(norm, "weight")] + ([(norm, "bias")] if bias is not None else [])
        if self.ladder.desync:  # desync adds the bias to a partial-gradient residual (ladder: after reduction)
            slots += [(m, "bias") for m in (layer.self_attention.linear_proj, layer.mlp.linear_fc2)
                      if m.bias is not None]
        return tuple(slots)

    def _enter_layer(self, index: int, r: Tensor) -> Tuple[Tensor, _Subst]:
        """Route layer ``index``'s partial-gradient parameters (and, at the first ladder/desync layer, the
        residual entering the partial region) through one gradient-summing node (module note). Called when the
        layer runs, so the parameters are read (an ODO all-gather waited) no earlier than needed."""
        if not (self.partial_grads and torch.is_grad_enabled()):
            return r, None
        slots = self._param_slots[index]
        entry = [r] if index == self.first_special else []
        views = sum_grads_over_tp(entry + [getattr(m, name) for m, name in slots], self.tp_group)
        if entry:
            r, views = views[0], views[1:]
        return r, {(id(m), name): v for (m, name), v in zip(slots, views)}

    # ---- forward -------------------------------------------------------------------------------------------

    def forward(self, hidden_states, attention_mask: Optional[Tensor], context: Optional[Tensor] = None,
                context_mask: Optional[Tensor] = None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, padding_mask=None, *, inference_params=None,
                dynamic_inference_decode_only: Optional[bool] = None) -> Tensor:
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if not self.pre_process:
            hidden_states = self.input_tensor
        has_special = self.first_special < len(self.layers)
        if has_special and (context is not None or context_mask is not None):
            raise ValueError("ladder/desync layers have no cross-attention: `context`/`context_mask` must be None")
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        attn_kw = dict(attention_mask=attention_mask, inference_context=inference_context,
                       rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                       rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                       packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)
        layer_kw = dict(attn_kw, context=context, context_mask=context_mask, padding_mask=padding_mask)
        segments = self.segments()
        for seg in segments:
            if not seg.special:
                hidden_states = self._maybe_checkpoint(
                    seg.checkpointed, self._standard_chunk(self._layers(seg), layer_kw), hidden_states)
        special = [seg for seg in segments if seg.special]
        if special:
            hidden_states = self._special_forward(special, hidden_states, attn_kw, padding_mask)

        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and not self.final_layernorm:
            hidden_states = hidden_states.clone()
        return hidden_states

    def segments(self) -> List[Segment]:
        """This stage's layers grouped as megatron's full-recompute options group them (recompute_plan.py)."""
        c = self.config
        return plan_segments(len(self.layers), self.first_special, c.recompute_granularity, c.recompute_method,
                             c.recompute_num_layers, self.training)

    def _layers(self, seg: Segment) -> List:
        return list(self.layers)[seg.start:seg.stop]

    def _indexed_layers(self, seg: Segment) -> List[Tuple[int, object]]:
        return list(zip(range(seg.start, seg.stop), self._layers(seg)))

    def _maybe_checkpoint(self, recompute: bool, fn: Callable, *args: Tensor):
        if recompute:
            return tensor_parallel.checkpoint(fn, self.config.distribute_saved_activations, *args)
        return fn(*args)

    def _standard_chunk(self, layers: List, kw: dict) -> Callable:
        def run(h: Tensor) -> Tensor:
            for layer in layers:
                h, _ = layer(hidden_states=h, **kw)
            return h
        return run

    def _special_forward(self, segments: List[Segment], r: Tensor, attn_kw: dict,
                         padding_mask: Optional[Tensor]) -> Tensor:
        # The input gradient leaves the partial region at the first layer's node (_enter_layer).
        if self.ladder.desync:
            for seg in segments:
                r = self._maybe_checkpoint(seg.checkpointed, self._desync_chunk(seg, attn_kw, padding_mask), r)
            # stage/block end: re-synchronise the residual before the final norm / next stage
            if not self.ladder.reduces(2 * self._layers(segments[-1])[-1].layer_number - 1):
                r = sync_all_reduce(r / self.tp, self.tp_group)
        else:
            pending: List[Tensor] = []
            for i, seg in enumerate(segments):
                last = i == len(segments) - 1
                fn = self._ladder_chunk(seg, attn_kw, padding_mask, last)
                outs = self._maybe_checkpoint(seg.checkpointed, fn, r, *pending)
                r, pending = outs[0], list(outs[1:])
        if self.partial_grads:
            r = scale_grad(r, 1.0 / self.tp)  # incoming gradient is replicated; enter partial form
        return r

    def _module_pairs(self, layer, attn_kw: dict, padding_mask: Optional[Tensor]):
        """(norm, row-parallel linear, module) of one layer's two modules, each module returning
        ``(partial output, that linear's bias)``."""
        return ((layer.input_layernorm, layer.self_attention.linear_proj,
                 lambda x: layer.self_attention(x, **attn_kw)),
                (layer.pre_mlp_layernorm, layer.mlp.linear_fc2, lambda x: layer.mlp(x, padding_mask=padding_mask)))

    # ---- ladder --------------------------------------------------------------------------------------------

    def _ladder_chunk(self, seg: Segment, attn_kw: dict, padding_mask: Optional[Tensor], last: bool) -> Callable:
        """Run the segment's layers with ladder wiring. Inputs: residual, then up to two finished outputs from
        before the chunk. The last chunk flushes (adds every pending output: before the final norm / at the stage
        end); others return the residual and their last two outputs, finished (waited) but not yet added, so that
        a recomputed chunk is a pure function of its inputs."""
        layers = self._indexed_layers(seg)

        def run(r_in: Tensor, *carried: Tensor):
            r, added = r_in, False
            queue: Deque[_Pending] = deque((None, self._carried(t), None) for t in carried)
            n_modules = 2 * len(layers)
            m = 0
            for index, layer in layers:
                subst: _Subst = None
                for j, (norm, _, fn) in enumerate(self._module_pairs(layer, attn_kw, padding_mask)):
                    if len(queue) == 2:
                        r, added = self._add_pending(r, queue.popleft()), True
                    if j == 0:  # after that add: in backward the layer's node runs before the add's launch
                        r, subst = self._enter_layer(index, r)
                    out, bias = fn(self._norm(norm, r, subst))
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
            if not added:  # a first one-layer chunk adds nothing; a checkpoint must not return its input (or a
                r = r.clone()  # view of it), whose data distribute_saved_activations replaces by this rank's slice
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

    def _desync_chunk(self, seg: Segment, attn_kw: dict, padding_mask: Optional[Tensor]) -> Callable:
        layers = self._indexed_layers(seg)

        def run(r: Tensor) -> Tensor:
            for index, layer in layers:
                r, subst = self._enter_layer(index, r)
                base = 2 * (layer.layer_number - 1)
                for j, (norm, linear, fn) in enumerate(self._module_pairs(layer, attn_kw, padding_mask)):
                    out, bias = fn(self._norm(norm, r, subst))
                    reduces = self.ladder.reduces(base + j)
                    # megatron: r + dropout(out + bias), one dropout draw over the full output (identical on all
                    # TP ranks). A reducing module sums the ranks' terms, so each adds bias / tp; a desynced one
                    # adds its partial output and the whole bias to its own residual (section 5).
                    if bias is not None:
                        bias = subst[(id(linear), "bias")] if subst is not None else bias
                        out = out + (bias / self.tp if reduces else bias)
                    out = F.dropout(out, p=self.config.hidden_dropout, training=self.training)
                    r = sync_all_reduce(out + r / self.tp, self.tp_group) if reduces else r + out
            return r
        return run

    # ---- helpers -------------------------------------------------------------------------------------------

    @staticmethod
    def _norm(norm: torch.nn.Module, x: Tensor, subst: _Subst) -> Tensor:
        if subst is None:
            return norm(x)
        w, b = subst[(id(norm), "weight")], subst.get((id(norm), "bias"))
        if type(norm) is torch.nn.LayerNorm:
            return F.layer_norm(x, norm.normalized_shape, w, b, norm.eps)
        if type(norm) is torch.nn.RMSNorm:
            return F.rms_norm(x, norm.normalized_shape, w, norm.eps)
        # any other norm (apex/megatron FusedLayerNorm, ...) reading self.weight / self.bias
        return torch.func.functional_call(norm, {"weight": w} if b is None else {"weight": w, "bias": b}, (x,))
