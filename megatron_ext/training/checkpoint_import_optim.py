"""Megatron's optimizer state in a Megatron-LM checkpoint, read as pretrain_gpt's canonical optimizer state.

[Note: the layouts]
Megatron-LM saves its distributed optimizer's Adam state with ``--ckpt-format torch_dist`` in one of two layouts
(``param_state_sharding_type`` in ``common.pt``), and with ``--ckpt-format torch`` in a third; all are read here:

* ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): model space. ``optimizer.state.param.<key>``
  (the fp32 main weight), ``optimizer.state.exp_avg.<key>`` and ``optimizer.state.exp_avg_sq.<key>`` have the
  model tensor's global name and shape, so each is read like the weight (``DistSource.model_shard``).
* ``dp_reshardable`` (Megatron-LM's default): bucket space. Each TP x PP position (``dp_group_idx_<t + TP * p>``, its
  rank in megatron-core's model-parallel group) stores every bucket of its gradient buffers as one flat tensor per
  state (``...gbuf_idx_<g>.dtype_<..>.bucket_idx_<b>.param``), of the bucket's unpadded size. Inside a bucket the
  parameters lie in reverse registration order, each starting at a multiple of 64 elements (megatron-core's
  ``_ParamAndGradBuffer``). Which parameter lies where is not stored, so it is recovered and proved: walking the
  bucket, the parameter placed at each offset must be one whose weight, as the checkpoint saved it, equals the main
  weight there cast to the weight's dtype (Megatron copies the main weights into the model after every step, and
  syncs them before saving), element for element. The gradient buffers follow the model chunks (``gbuf_idx`` is the
  chunk), and a chunk registers its parameters as megatron-core's GPT modules do (:func:`registration_order`: the
  embedding, each layer's modules in order, the final norm, the output layer), so the walk expects that order
  reversed. Where the expected parameter does not fit, the one other parameter of the chunk that does is taken; none,
  or several (equal weights, as layer norms still at 1.0 in bf16 early in training, which only the order tells
  apart), refuses the import, naming the bucket, as does a bucket left with elements no parameter explains: the
  state is carried exactly or not at all.
* torch format: ``distrib_optim.pt`` beside each position's ``model_optim_rng.pt`` (``save_parameter_state``,
  gathered on DP rank 0) holds per gradient buffer one flat tensor per state: its buckets back to back, each cut at
  its unpadded end. The same walk places the parameters; at a bucket's end, which need not be 64-aligned, the next
  parameter starts right there.

Megatron-LM's default optimizer, without ``--use-distributed-optimizer``, is not distributed
(``Float16OptimizerWithFloat16Params`` for bf16/fp16 with fp32 main weights, ``FP32Optimizer`` for fp32, whose main
weights are the weights). With torch_dist it saves in model space like ``fully_reshardable``
(``optimizer.state.fp32_param.<key>`` for the main weight, the moments as above, the step once as ``common_step``);
with the torch format, torch Adam's ``state_dict()`` by param-group index (:func:`non_distributed_state`).

The step comes from the optimizer's param groups (the same on every position; the non-distributed optimizers':
Adam's own), and the groups' hyper-parameters (``lr``, ``weight_decay``, ``wd_mult``, ...) are kept, each group
with the key megatron-core's standard overrides give it (:func:`group_key`), which pretrain_gpt's loader matches the
resuming run's groups by; an fp16 run's dynamic loss scale and its trackers carry over (megatron-core's
``DynamicGradScaler`` state is the one pretrain_gpt's scaler keeps). Only Adam is read. Megatron's chained optimizers
(``--overlap-param-gather-with-optimizer-step``) and the other (deprecated) layouts are not read, and the tool says
which: resume those with ``--no-load-optim``. A state that is there but cannot be placed stops the import,
naming why; ``--no-load-optim`` then imports the weights alone.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..optimizer.checkpoint import CANONICAL_FORMAT, canonical_entry
from ..optimizer.dist_checkpoint import SHARDED_FORMATS, sharded_header
from .checkpointing import CheckpointError

LAYOUTS = ("dp_reshardable", "fully_reshardable")
NON_DISTRIBUTED = "non-distributed"
_FIELDS = (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))   # (ours, Megatron's)
# the non-distributed optimizers' model-space names: a bf16/fp16 run's main weight is its fp32_param; an fp32 run's,
# the weight itself
_FIELDS_NON_DISTRIBUTED = (("master", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
# megatron-core up to 0.19 (fixed upstream on 2026-08-21, NVIDIA/Megatron-LM#5077) writes the fully_reshardable
# layout from the gradient buffer with its buckets' end padding removed but indexes it with the padded offsets: every
# parameter after a buffer's first bucket gets another place's state. Its main weights then differ from its weights.
SHIFTED_MODEL_SPACE = ("its main weights are not its weights: megatron-core up to 0.19 writes Megatron's "
                       "fully_reshardable optimizer state shifted after a gradient buffer's first bucket (fixed "
                       "upstream in NVIDIA/Megatron-LM#5077), or weights and optimizer state come from two saves")


def is_main_of(main: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp32 main weights ``main`` are those of ``weight`` (Megatron copies its main weights into the model
    after every step): cast to the weight's dtype, compared where the weight lies (a live model's may be on the GPU,
    the checkpoint's state on the host)."""
    return torch.equal(main.to(weight.device, weight.dtype), weight)


BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                     r"\.param$")
PARAM_ALIGN = 64   # megatron-core's _ParamAndGradBuffer: a parameter starts at a multiple of 64 elements
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")   # is_embedding_or_output_parameter


def saved_layout(saved: Dict[str, Any]) -> Tuple[Optional[str], str]:
    """(the layout of Megatron's optimizer state this import reads, or None; why not, for the log)."""
    optimizer = saved.get("optimizer")
    if optimizer == "--no-load-optim":
        return None, "not read: --no-load-optim"
    if not isinstance(optimizer, dict):
        return None, "saved without optimizer state"
    if optimizer and all(isinstance(k, int) for k in optimizer):
        return None, ("Megatron's chained optimizers (--overlap-param-gather-with-optimizer-step, or separate "
                      "expert optimizers) are not read")
    layout = optimizer.get("param_state_sharding_type")
    if layout is None:
        if torch_format_kind(optimizer) != NON_DISTRIBUTED:
            return None, "an optimizer state of no layout this import knows"
        return non_distributed_adam(optimizer)
    if layout not in LAYOUTS:
        return None, f"Megatron's {layout} optimizer layout is not read (only {' and '.join(LAYOUTS)})"
    return layout, ""


def optimizer_label(layout: str) -> str:
    """How the log names the optimizer state of ``layout``."""
    return ("Megatron's non-distributed" if layout == NON_DISTRIBUTED else
            f"Megatron's DistributedOptimizer's ({layout})")


def non_distributed_adam(optimizer: Dict[str, Any]) -> Tuple[Optional[str], str]:
    """(NON_DISTRIBUTED, "") where Megatron's non-distributed optimizer saved Adam's state, else (None, why not)."""
    adam = _adam_state(optimizer)
    if not adam.get("state"):   # (torch_dist keeps only the shared step there, megatron-core's common_step)
        return None, "Megatron's non-distributed optimizer saved no Adam state (saved before its first step?)"
    if not all(isinstance(g, dict) and "betas" in g for g in adam["param_groups"]):
        return None, "Megatron's non-distributed optimizer is not Adam (only Adam's state is read)"
    return NON_DISTRIBUTED, ""


def torch_format_kind(optimizer: Any) -> Optional[str]:
    """Whose ``state_dict()`` Megatron-LM saved as ``optimizer`` (torch format; torch_dist's ``common.pt`` keeps the
    same frame): the DistributedOptimizer's common part (param groups, the state apart), the non-distributed
    optimizer's (torch Adam's state inside), or neither (None)."""
    if not isinstance(optimizer, dict) or "format" in optimizer:
        return None
    adam = _adam_state(optimizer)
    if not isinstance(adam.get("param_groups"), list):
        return None
    return NON_DISTRIBUTED if "state" in adam else "distributed"


def _adam_state(optimizer: Dict[str, Any]) -> Dict[str, Any]:
    """The torch optimizer's ``state_dict()`` inside Megatron's: a mixed-precision optimizer's ``optimizer`` entry
    (beside ``grad_scaler`` and its fp32 main weights), an fp32 one's whole state."""
    inner = optimizer.get("optimizer")
    return inner if isinstance(inner, dict) else optimizer


def group_key(group: Dict[str, Any], args: Dict[str, Any]) -> Optional[tuple]:
    """A saved param group's key as megatron-core's standard overrides give it (``param_group_override_to_tuple``:
    no weight decay, ``--decoupled-lr``), the key the ODO records (``param_groups.py``); a group with a learning-rate
    multiplier has none (its scale_lr_cond is not known here)."""
    items: Dict[str, Any] = {}
    if float(group.get("wd_mult", 1.0)) != 1.0:
        items["wd_mult"] = float(group["wd_mult"])
    decoupled_lr = args.get("decoupled_lr")
    # (megatron-core before 0.16 marks the group; 0.16 knows it by its override: its own max_lr, off the default)
    if group.get("is_decoupled_lr") or (decoupled_lr is not None and group.get("default_config") is False
                                        and group.get("max_lr") == decoupled_lr):
        items["max_lr"] = decoupled_lr
        if args.get("decoupled_min_lr") is not None:
            items["min_lr"] = args["decoupled_min_lr"]
    return tuple(sorted(items.items())) or None


def param_key(name: str, weight: torch.Tensor, args: Dict[str, Any]) -> Optional[tuple]:
    """The key megatron-core's standard overrides give the parameter ``name`` (a local or Transformer Engine name):
    no weight decay for biases and 1-D tensors (q/k layer norms keep it under ``--apply-wd-to-qk-layernorm``), the
    decoupled learning rate for the word embeddings and the output layer under ``--decoupled-lr``."""
    items: Dict[str, Any] = {}
    if (weight.dim() == 1 or name.endswith(".bias")) and not (
            args.get("apply_wd_to_qk_layernorm") and ("q_layernorm." in name or "k_layernorm." in name)):
        items["wd_mult"] = 0.0
    if args.get("decoupled_lr") is not None and name.endswith(_EMBEDDING_OR_OUTPUT):
        items["max_lr"] = args["decoupled_lr"]
        if args.get("decoupled_min_lr") is not None:
            items["min_lr"] = args["decoupled_min_lr"]
    return tuple(sorted(items.items())) or None


def canonical_header(saved: Any, where: str, scaler: Any = None, args: Optional[Dict[str, Any]] = None
                     ) -> Dict[str, Any]:
    """The canonical state's header (type, step, param groups, loss scaler) from Megatron's optimizer's
    ``state_dict()`` (``{"optimizer": {"param_groups": [...]}, "grad_scaler": ...}``): the step is the one its param
    groups record (the non-distributed optimizers': Adam's own, per parameter or megatron-core's ``common_step``).
    ``scaler``: the loss scaler's state where it was saved apart (torch_dist's bucket layout). The plug-in's torch_dist
    state (``SHARDED_FORMATS``, Megatron's model-space keys) carries the ODO's own header. ``args``: the saving
    run's; with them each group records its key (:func:`group_key`), which the loader matches the resuming run's
    groups by (else by ``wd_mult`` and ``lr_mult``, or position: a decoupled-LR group shares those with the default
    one)."""
    if isinstance(saved, dict) and saved.get("format") in SHARDED_FORMATS:   # the plug-in's own (the ODO's keys)
        header = sharded_header(saved)
        return {"format": CANONICAL_FORMAT, **{k: header[k] for k in ("optimizer", "step", "param_groups",
                                                                      "grad_scaler")}}
    scaler = scaler if scaler is not None else (saved.get("grad_scaler") if isinstance(saved, dict) else None)
    adam = _adam_state(saved) if isinstance(saved, dict) else {}
    groups = adam.get("param_groups")
    if not groups:
        raise CheckpointError(f"{where}: Megatron's optimizer state without its param groups: import with "
                              "--no-load-optim")
    steps = {int(g["step"]) for g in groups if "step" in g}
    state = adam.get("state")
    if not steps and isinstance(state, dict):   # the non-distributed optimizers: Adam's own per-parameter steps
        steps = ({int(state["common_step"])} if "common_step" in state else   # (torch_dist: shared, saved once)
                 {int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s})
    if len(steps) != 1:
        raise CheckpointError(f"{where}: the optimizer's param groups give the steps {sorted(steps)}, not one: "
                              "import with --no-load-optim")
    dynamic = isinstance(scaler, dict) and "scale" in scaler   # (a constant scaler saves {}: the run's flag rules)
    keys = [group_key(g, args) for g in groups] if args is not None else []
    keyed = len(set(keys)) == len(groups) and all(float(g.get("lr_mult", 1.0)) == 1.0 for g in groups)
    return {"format": CANONICAL_FORMAT, "optimizer": "AdamW", "step": steps.pop(),
            "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "step")},
                              **({"overrides": keys[i]} if keyed else {})} for i, g in enumerate(groups)],
            "grad_scaler": {"scale": float(scaler["scale"]), "growth_tracker": int(scaler.get("growth_tracker", 0)),
                            "hysteresis_tracker": int(scaler.get("hysteresis_tracker", 0))} if dynamic else None}


def torch_format_state(saved: Dict[str, Any], path: str, chunks: List[Dict[str, Any]], te_names: Callable[[str], str],
                       te_saved: bool, prefix: str, args: Dict[str, Any],
                       order: Optional[List[Tuple[int, str]]] = None, copy: bool = True
                       ) -> Tuple[Optional[Dict[str, Any]], str]:
    """The canonical optimizer state of one position of a ``--ckpt-format torch`` checkpoint and whose it is (for the
    log), or (None, why not). Megatron's DistributedOptimizer saves its ``state_dict()`` in ``model_optim_rng.pt`` at
    ``path`` and its parameter state gathered in ``distrib_optim.pt`` beside it (each gradient buffer's buckets
    coalesced), placed by the walk of the module note against the position's weights ``chunks``; its non-distributed
    optimizer's state is read by :func:`non_distributed_state`. ``te_names``: a saved name's Transformer Engine name
    (the layer table's); ``prefix``: the canonical names' (``module.`` under bf16/fp16); ``args``: the saving run's
    (``imported_args``); ``order``: the (chunk, name) registration order where the live model gives it (the
    Megatron-LM plug-in), instead of the layer tables'; ``copy=False``: the distributed optimizer's states as views
    of the memory-mapped ``distrib_optim.pt`` (a loader that takes its slices), not copies (a writer)."""
    import os

    from .checkpoint_import import _read

    common = saved.get("optimizer")
    if common is None:
        return None, "saved without optimizer state"
    if isinstance(common, list):
        return None, ("Megatron's chained optimizers (--overlap-param-gather-with-optimizer-step, or separate expert "
                      "optimizers) are not read")
    if not isinstance(common, dict):
        return None, "an optimizer state of no layout this import knows"
    if torch_format_kind(common) == NON_DISTRIBUTED:
        return non_distributed_state(saved, path, chunks, te_names, te_saved, prefix, args, order)
    param_state_path = os.path.join(os.path.dirname(path), "distrib_optim.pt")
    if not os.path.isfile(param_state_path):
        return None, f"no {param_state_path}: the DistributedOptimizer's parameter state is missing"
    state = _read(param_state_path)
    if not state.get("buckets_coalesced"):
        return None, f"{param_state_path} is in an older DistributedOptimizer layout (buckets not coalesced), not read"
    gbufs = sorted(k for k in state if isinstance(k, int))
    if gbufs != list(range(len(chunks))) or any(len(state[g]) != 1 for g in gbufs):
        return None, (f"{param_state_path} holds gradient buffers {gbufs}, not one per model chunk ({len(chunks)}) "
                      "of one dtype: not read")
    mine = [(c, te_names(key), key) for c, chunk in enumerate(chunks) for key, value in chunk.items()
            if torch.is_tensor(value) and not key.endswith("_extra_state")]
    trusted = order is not None or order_is_known(mine)
    order = order if order is not None else _tables_order(mine, te_saved)
    weights = {(c, key): chunks[c][key] for c, _, key in mine}
    out: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    for g in gbufs:
        (world,) = state[g].values()
        fields = {ours: world[theirs] for ours, theirs in _FIELDS}
        if any(t.numel() != world.get("numel_unpadded", t.numel()) for t in fields.values()):
            raise CheckpointError(f"{param_state_path}: gradient buffer {g}'s states are not of its unpadded size "
                                  f"{world.get('numel_unpadded')}: import with --no-load-optim")
        expected = [p for p in reversed(order) if p[0] == g]
        out.update(walk_buffer(fields, expected, weights, trusted, param_state_path, f"gradient buffer {g}",
                               coalesced=True, copy=copy))
    check_all_placed(order, out, param_state_path, "this position")
    params = {}
    for (c, key), entry in out.items():
        params[prefix + key if len(chunks) == 1 else f"{c}.{prefix}{key}"] = canonical_entry(entry)
    return {**canonical_header(common, path, args=args), "params": params}, "Megatron's DistributedOptimizer's"


def non_distributed_state(saved: Dict[str, Any], path: str, chunks: List[Dict[str, Any]],
                          te_names: Callable[[str], str], te_saved: bool, prefix: str, args: Dict[str, Any],
                          order: Optional[List[Tuple[int, str]]] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    """The canonical optimizer state of one position of a ``--ckpt-format torch`` checkpoint that Megatron's
    non-distributed optimizer saved (its ``state_dict()``: torch Adam's, whose per-parameter state is keyed by the
    parameter's index in its param groups, and a bf16/fp16 run's fp32 main weights group by group), or (None, why not).

    The groups do not name their parameters. megatron-core fills them walking the model chunks' parameters in
    registration order (:func:`registration_order`), each into the group of its standard overrides
    (:func:`param_key`: no weight decay for biases and 1-D tensors, as the saving run's
    ``--apply-wd-to-qk-layernorm`` excepts q/k layer norms; ``--decoupled-lr`` for the word embeddings and the output
    layer), which the saved groups show (:func:`group_key`). So the j-th index of a group is the j-th parameter of
    that kind in that order. Every parameter is checked by its state's shape and, where a main weight is saved
    (bf16/fp16), by the main weight cast to the weight's dtype equalling the weight. Equal shapes with equal weights
    (layer norms at 1.0 early in training) and fp32 runs' weights (their own main weights) rest on the order itself,
    which is megatron-core's wherever every name is in the layer tables (tested against megatron-core's own model and
    optimizer), and refused otherwise. Groups with a learning-rate multiplier or expert-parallel ones, and optimizers
    other than Adam, are not read. ``saved``: the position's ``model_optim_rng.pt``; the rest as
    :func:`torch_format_state`'s."""
    common = saved["optimizer"]
    adam = _adam_state(common)
    groups, state = adam["param_groups"], adam["state"]   # (torch_format_kind: there)
    layout, why_not = non_distributed_adam(common)
    if layout is None:
        return None, why_not
    if any(float(g.get("lr_mult", 1.0)) != 1.0 or g.get("is_expert_parallel") for g in groups):
        return None, ("Megatron's non-distributed optimizer has param groups with a learning-rate multiplier or "
                      "expert parallelism: not read")
    keys = [group_key(g, args) for g in groups]
    if len(set(keys)) != len(keys):
        return None, (f"Megatron's non-distributed optimizer's param groups are not told apart by megatron-core's "
                      f"standard overrides ({keys}): not read")
    masters = common.get("fp32_from_fp16_params") if adam is not common else None
    mine = [(c, te_names(key), key) for c, chunk in enumerate(chunks) for key, value in chunk.items()
            if torch.is_tensor(value) and not key.endswith("_extra_state")]
    unknown = [key for _, te, key in mine if not order_is_known([(0, te, key)])]
    if unknown and order is None:   # (equal shapes in a group are told apart by the order alone where no main weight
        raise CheckpointError(     # is saved)
            f"{path}: {unknown[0]} is not in megatron-core's registration order as this import knows it, which places "
            "the non-distributed optimizer's state: import with --no-load-optim")
    members: List[List[Tuple[int, str]]] = [[] for _ in groups]
    for c, key in order if order is not None else _tables_order(mine, te_saved):
        wanted = param_key(key, chunks[c][key], args)
        if wanted not in keys:
            raise CheckpointError(f"{path}: {key} has no param group of its overrides {wanted} in Megatron's "
                                  "optimizer state: import with --no-load-optim")
        members[keys.index(wanted)].append((c, key))
    params = {}
    for i, (group, names) in enumerate(zip(groups, members)):
        ids = list(group.get("params", []))
        if len(ids) != len(names):
            raise CheckpointError(f"{path}: the optimizer's param group {i} holds {len(ids)} parameters, the model "
                                  f"{len(names)} of its overrides {keys[i]}: import with --no-load-optim")
        # (the fp32 main weights of the group's bf16/fp16 weights in its order; an fp32 weight is its own)
        mains = iter(masters[i] if masters and i < len(masters) else [])
        for index, (c, key) in zip(ids, names):
            weight, entry = chunks[c][key], state.get(index, {})
            fields = {"master": weight if weight.dtype == torch.float32 else next(mains, None),
                      "exp_avg": entry.get("exp_avg"), "exp_avg_sq": entry.get("exp_avg_sq")}
            if not all(torch.is_tensor(t) and t.shape == weight.shape for t in fields.values()) or not is_main_of(
                    fields["master"], weight):
                raise CheckpointError(f"{path}: the optimizer's parameter {index} (param group {i}) is not {key}'s "
                                      "state (shape or main weight): import with --no-load-optim")
            params[prefix + key if len(chunks) == 1 else f"{c}.{prefix}{key}"] = canonical_entry(
                {ours: t.float() for ours, t in fields.items()})
    return {**canonical_header(common, path, args=args), "params": params}, optimizer_label(NON_DISTRIBUTED)


class MegatronOptimizerState:
    """The DistributedOptimizer's Adam state of a torch_dist checkpoint, per TP rank shard (see the module note).

    ``src``: the checkpoint's :class:`~.checkpoint_import_dist.DistSource`; ``positions``: every (stage, chunk, local
    key, global key) the saving layout holds (``checkpoint_reshard._target_keys``)."""

    def __init__(self, src: Any, saved: Dict[str, Any], layout: str,
                 positions: List[Tuple[int, int, str, str]]) -> None:
        self.src, self.layout = src, layout
        self._positions = positions
        self._cache: Tuple[Optional[Tuple[int, int]], Dict[Tuple[int, str], Dict[str, torch.Tensor]]] = (None, {})
        groups = src.read_object("optimizer.distributed.dp_group_idx_0.optimizer") if layout == "dp_reshardable" \
            else saved["optimizer"]
        scaler = (src.read_object("optimizer.distributed.dp_group_idx_0.grad_scaler")
                  if layout == "dp_reshardable" and src.has_object("optimizer.distributed.dp_group_idx_0.grad_scaler")
                  else None)
        self.header = canonical_header(groups, src.ckpt, scaler, src.args)
        self._odo_state = isinstance(groups, dict) and groups.get("format") in SHARDED_FORMATS
        self._te_saved = src.saved_impl != "local"   # the layer spec the saving run registered
        self._fields = _FIELDS_NON_DISTRIBUTED if layout == NON_DISTRIBUTED else _FIELDS
        # model space: every model tensor's state under its name; but an fp32 weight in the non-distributed
        # optimizers is its own main weight (no fp32_param of it is saved)
        self._own_master = {key for key in src.model_stored_keys() if layout == NON_DISTRIBUTED
                            and not src.has_stored(f"optimizer.state.fp32_param.{key}")
                            and src.stored_dtype(key) == torch.float32}
        if layout != "dp_reshardable":
            missing = [f"optimizer.state.{theirs}.{key}" for key in src.model_stored_keys()
                       for ours, theirs in self._fields
                       if not (src.has_stored(f"optimizer.state.{theirs}.{key}")
                               or (ours == "master" and key in self._own_master))]
            if missing:
                raise CheckpointError(f"{src.ckpt}: {layout} optimizer state without {missing[0]} (only Adam's "
                                      "state is read): import with --no-load-optim")

    def shard(self, stage: int, chunk: int, key: str, stored: str, tp: int, rank: int, swiglu: bool
              ) -> Dict[str, torch.Tensor]:
        """TP rank ``rank``'s (master, exp_avg, exp_avg_sq) of the parameter ``key`` of (stage, chunk), in its
        shape; ``stored``: its name in the checkpoint (a tied output layer's is the embedding's)."""
        if self.layout != "dp_reshardable":
            own = self.src.stored_key(stored) in self._own_master
            out = {ours: self.src.model_shard(stored, tp, rank, swiglu, prefix="" if ours == "master" and own
                                              else f"optimizer.state.{theirs}.")
                   for ours, theirs in self._fields}
            if not own and not self._odo_state:   # (the ODO's weights may be quantized copies of its main weights)
                weight = self.src.model_shard(stored, tp, rank, swiglu)
                if not is_main_of(out["master"], weight):
                    raise CheckpointError(f"{self.src.ckpt}: {key} (TP rank {rank}): {SHIFTED_MODEL_SPACE}: import "
                                          "with --no-load-optim")
            return out
        where, state = self._cache
        if where != (stage, rank):
            state = self._read_position(stage, rank, tp, swiglu)
            self._cache = ((stage, rank), state)
        return state[chunk, key]

    def _read_position(self, stage: int, rank: int, tp: int, swiglu: bool
                       ) -> Dict[Tuple[int, str], Dict[str, torch.Tensor]]:
        """Every parameter's state of one position, placed by the walk of the module note."""
        group = rank + tp * stage
        buckets = sorted((int(m.group(2)), int(m.group(4)), k[: -len(".param")])
                         for k in self.src.stored_keys("optimizer.") if (m := BUCKET_KEY.match(k))
                         and int(m.group(1)) == group)
        if not buckets:
            raise CheckpointError(f"{self.src.ckpt}: no optimizer buckets for TP rank {rank}, stage {stage} "
                                  f"(dp_group_idx_{group}): import with --no-load-optim")
        mine = [(c, key, g) for s, c, key, g in self._positions if s == stage]
        order, trusted = registration_order(mine, self._te_saved), order_is_known(mine)
        weights = {(c, key): self.src.model_shard(self.src.stored_name(g), tp, rank, swiglu) for c, key, g in mine}
        chunks = sorted({c for c, _ in order})
        gbufs = sorted({b[0] for b in buckets})
        if gbufs != list(range(len(chunks))):
            raise CheckpointError(f"{self.src.ckpt}: dp_group_idx_{group} has gradient buffers {gbufs}, not one per "
                                  f"model chunk ({len(chunks)}): parameters of several dtypes are not read; import "
                                  "with --no-load-optim")
        out: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
        where = f"TP rank {rank}, stage {stage}"
        for gbuf, _, prefix in buckets:
            fields = {ours: self.src.read_flat(f"{prefix}.{theirs}") for ours, theirs in _FIELDS}
            expected = [p for p in reversed(order) if p[0] == chunks[gbuf] and p not in out]
            out.update(walk_buffer(fields, expected, weights, trusted, f"{self.src.ckpt}: {prefix}", where))
        check_all_placed(order, out, self.src.ckpt, where)
        return out


def check_all_placed(order: List[Tuple[int, str]], out: Dict[Tuple[int, str], Any], ckpt: str, where: str) -> None:
    missing = [k for k in order if k not in out]
    if missing:
        raise CheckpointError(f"{ckpt}: no optimizer state for {missing[0][1]} ({where}) in its buffers: import with "
                              "--no-load-optim")


def walk_buffer(fields: Dict[str, torch.Tensor], expected: List[Tuple[int, str]],
                weights: Dict[Tuple[int, str], torch.Tensor], trusted: bool, what: str, where: str,
                coalesced: bool = False, copy: bool = True) -> Dict[Tuple[int, str], Dict[str, torch.Tensor]]:
    """Place the parameters ``expected`` (in the order they lie) in flat optimizer state ``fields`` (``master``,
    ``exp_avg``, ``exp_avg_sq``) by the walk of the module note; returns each one's state in its weight's shape.
    ``coalesced``: the buckets of a whole gradient buffer back to back, each cut at its unpadded end (the torch
    format's ``distrib_optim.pt``), so a parameter starts either 64-aligned from its bucket's start or right where
    the last one ended (a new bucket). Where both fit, the aligned start is tried first and the other taken if the
    rest of the buffer cannot be walked from it (equal weights, as layer norms at 1.0, can fit at both)."""
    main, end = fields["master"], fields["master"].numel()
    # depth-first over (offset, bucket start, parameters left, placements so far as a linked list)
    stack: List[Tuple[int, int, Tuple[Tuple[int, str], ...], Any]] = [(0, 0, tuple(expected), None)]
    deepest: Tuple[int, Any, Tuple[Tuple[int, str], ...]] = (-1, [], tuple(expected))   # (element, fits, left)
    while stack:
        offset, bucket_start, left, placed = stack.pop()
        aligned = bucket_start + -(-(offset - bucket_start) // PARAM_ALIGN) * PARAM_ALIGN
        if aligned >= end and (not coalesced or offset >= end):
            out: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
            while placed is not None:
                (p, at), placed = placed
                shape = weights[p].shape
                out[p] = {ours: t[at:at + shape.numel()].reshape(shape) for ours, t in fields.items()}
                if copy:
                    out[p] = {ours: t.clone() for ours, t in out[p].items()}
            return out
        starts = [(aligned, bucket_start)] if aligned < end else []
        if coalesced and aligned != offset and offset < end:
            starts.append((offset, offset))   # a new bucket starts where the last parameter ended
        for at, bucket in reversed(starts):   # (the aligned start is popped first)
            found = _place(main, at, end, list(left), weights, trusted)
            if isinstance(found, list):
                if at > deepest[0]:
                    deepest = (at, found, left)
                continue
            rest = tuple(p for p in left if p != found)
            stack.append((at + weights[found].numel(), bucket, rest, ((found, at), placed)))
    at, found, left = deepest
    fit = ("no parameter" if not found else
           f"{len(found)} parameters ({', '.join(k for _, k in found[:3])}) with equal weights")
    raise CheckpointError(
        f"{what}: {fit} of {where} fit the main weights at element {at} of {end} where megatron-core's order "
        f"expects {left[0][1] if left else 'none'} (not its bucket layout, or weights and optimizer from two saves): "
        "import with --no-load-optim")


def _place(main: torch.Tensor, offset: int, end: int, expected: List[Tuple[int, str]],
           weights: Dict[Tuple[int, str], torch.Tensor], trusted: bool = True) -> Any:
    """The parameter whose weight is the main weights at ``offset`` (cast to its dtype, compared where the weight
    lies: a live model's may be on the GPU, the checkpoint's state on the host): the next one in
    ``expected`` order if it is and the order is ``trusted``, else the only one that is; otherwise the list of those
    that are (empty: none; several: equal weights nothing here tells apart)."""
    def fits(p: Tuple[int, str]) -> bool:
        w = weights[p].reshape(-1)
        n = w.numel()
        return offset + n <= end and is_main_of(main[offset:offset + n], w)

    if trusted and expected and fits(expected[0]):
        return expected[0]
    head = main[offset:offset + 8]
    found = [p for p in expected[1 if trusted else 0:]   # the first elements rule most out before a whole comparison
             if is_main_of(head[:weights[p].numel()], weights[p].reshape(-1)[:head.numel()])
             and fits(p)]
    return found[0] if len(found) == 1 else found


# The parameters of a megatron-core GPT layer in registration order, by their torch_dist (Transformer Engine) names:
# SelfAttention builds linear_proj (in Attention) before linear_qkv and its q/k norms; Transformer Engine's
# LayerNormLinear registers its layer norm before its weight and bias. The local spec has the norms as modules of their
# own, input_layernorm before self_attention and pre_mlp_layernorm before mlp (tested against megatron-core).
_TE_LAYER = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
             "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
             "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
             "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
             "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
             "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_LOCAL_LAYER = _TE_LAYER[2:4] + _TE_LAYER[:2] + _TE_LAYER[4:]
_OUTSIDE_LAYERS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                   "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
                   "output_layer.bias")
_LAYER_KEY = re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.(.+)$")
# where a key lies in a GPT chunk's registration (and state-dict) order
MODEL_GROUPS = (r"(^|\.)embedding\.", r"(^|\.)decoder\.layers\.", r"(^|\.)decoder\.", r"(^|\.)output_layer\.")


def registration_order(params: List[Tuple[int, str, str]], te_saved: bool) -> List[Tuple[int, str]]:
    """(chunk, local key) of ``params`` ((chunk, local key, global key), torch_dist names) in the order megatron-core
    registers them (``te_saved``: the saving run's layers were Transformer Engine's): by chunk, then the embedding,
    the layers by index and their modules in order, the final norm, the output layer. A name the tables do not know
    comes after the known ones of its group or layer (see :func:`order_is_known`)."""
    table = _TE_LAYER if te_saved else _LOCAL_LAYER

    def rank(item: Tuple[int, int, str, str]) -> tuple:
        i, c, key, _ = item
        group = next(n for n, pattern in enumerate(MODEL_GROUPS) if re.search(pattern, key))
        m = _LAYER_KEY.match(key)
        if m is None:
            outside = next((n for n, name in enumerate(_OUTSIDE_LAYERS) if key.endswith(name)), len(_OUTSIDE_LAYERS))
            return c, group, 0, outside, i
        inner = table.index(m.group(2)) if m.group(2) in table else len(table)
        return c, group, int(m.group(1)), inner, i

    ranked = sorted(((i, c, key, g) for i, (c, key, g) in enumerate(params)), key=rank)
    return [(c, key) for _, c, key, _ in ranked]


def _tables_order(mine: List[Tuple[int, str, str]], te_saved: bool) -> List[Tuple[int, str]]:
    """(chunk, saved name) of ``mine`` ((chunk, table name, saved name)) in :func:`registration_order`."""
    by_order = {(c, te): key for c, te, key in mine}
    return [(c, by_order[c, te]) for c, te in registration_order(mine, te_saved)]


def order_is_known(params: List[Tuple[int, str, str]]) -> bool:
    """Whether every parameter is in the tables, so that :func:`registration_order` is megatron-core's and may
    break ties between equal weights; otherwise the walk takes a parameter only where no other fits."""
    return all(m.group(2) in _TE_LAYER if m else any(key.endswith(name) for name in _OUTSIDE_LAYERS)
               for key, m in ((key, _LAYER_KEY.match(key)) for _, key, _ in params))
