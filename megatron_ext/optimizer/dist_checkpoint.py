"""The ODO's state for megatron-core dist-checkpointing (``--ckpt-format torch_dist``), in model space.

[Note: model-space blocks]
A rank's piece of a parameter is a flat range ``[start, end)`` of it, which is not a block of the tensor, and
megatron-core 0.16 refuses ``ShardedTensor.flattened_range``. A flat range of a C-ordered tensor is the union of at
most ``2 * ndim - 1`` blocks (a partial innermost row, whole rows, ..., a partial last row), and each block is an
unevenly sharded ``ShardedTensor`` (``axis_fragmentations=None``: megatron-core leaves those to torch DCP, which
checks that the blocks of all ranks cover each tensor once). The blocks lie in the model parameter's own tensor:
its key under ``optimizer.state.param.`` (the fp32 main weight), ``optimizer.state.exp_avg.`` and so on, its global
shape and offset (tensor-parallel split, layers stacked), its replica (the tensor-parallel copies of a layer norm
are written once) -- the layout of Megatron's DistributedOptimizer's ``fully_reshardable`` sharding type. So a
checkpoint resumes at any DP size, bucket size, backend or sharding plan, and at other TP/PP sizes (megatron-core
reads the blocks each new rank asks for); and a checkpoint Megatron's DistributedOptimizer saved in that layout
carries the same tensors (the Megatron-LM plug-in reads its shared part, ``megatron_lm/optimizer_state.py``).

The shared part (update rule, step, param groups, loss scaler) is a common entry, written once by global rank 0 and
read by every rank, as in Megatron's layout. It is written twice over: the ODO's own header, and under
``"optimizer"`` and ``"grad_scaler"`` what Megatron's DistributedOptimizer's ``load_state_dict`` reads (its
``state_dict()``: the param groups without their parameters, each with the step and the keys its groups are matched
by, and the loss scale as a tensor), so a run switches back from the ODO to Megatron's optimizer with its Adam
state (:func:`megatron_common`). Checkpoints of the first version (``megatron_ext.odo/1-sharded``) kept the update
rule under ``"optimizer"`` and load as before (:func:`sharded_header`). A block holds a copy of the rank's state,
so an asynchronous save may go on writing while training updates the state (a CPU state is copied for it;
megatron-core's writer copies a CUDA one to the host itself).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from .checkpoint import LOCAL_FORMAT
from .inner_optimizer import inner_step

if TYPE_CHECKING:   # (imported lazily at run time: megatron-core is needed only by those who checkpoint with it)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

SHARDED_FORMAT = "megatron_ext.odo/2-sharded"
SHARDED_FORMATS = (SHARDED_FORMAT, "megatron_ext.odo/1-sharded")   # (1: "optimizer" held the update rule)
MEGATRON_LAYOUT = "fully_reshardable"   # Megatron-LM: --dist-ckpt-optim-fully-reshardable
PREFIX = "optimizer.state."
_NO_TENSOR = "the model's sharded_state_dict has no tensor for "
_PASS_THE_MODELS = ": pass the model's sharded state dict (model.sharded_state_dict()) to the optimizer's"
Block = Tuple[Tuple[int, ...], Tuple[int, ...]]   # (offset, shape) in the tensor


def flat_range_blocks(shape: Sequence[int], start: int, end: int) -> List[Block]:
    """The blocks whose union is the elements ``[start, end)`` of a C-ordered tensor of ``shape``, in that order:
    each one is contiguous in the flattened tensor, and they follow one another."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    row, last = start // inner, end // inner
    blocks: List[Block] = []
    if start % inner:   # the partial first row
        stop = min(end, (row + 1) * inner)
        blocks += [((row, *o), (1, *s)) for o, s in flat_range_blocks(shape[1:], start - row * inner,
                                                                       stop - row * inner)]
        row += 1
        if stop == end:
            return blocks
    if last > row:      # whole rows
        blocks.append(((row, *(0,) * (len(shape) - 1)), (last - row, *shape[1:])))
    if end % inner:     # the partial last row
        blocks += [((last, *o), (1, *s)) for o, s in flat_range_blocks(shape[1:], 0, end - last * inner)]
    return blocks


def model_tensors(model_sharded_state_dict: Any) -> Dict[int, List[Tuple["ShardedTensor", int]]]:
    """Parameter (by id) -> the tensors megatron-core saves it as, each with its offset in the flattened parameter.
    A ``ShardedTensorFactory`` (SwiGLU's ``linear_fc1``, saved as two halves) is built on a meta tensor to find
    where each of its tensors lies."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: Dict[int, List[Tuple[ShardedTensor, int]]] = {}
    for sh in nested_values(model_sharded_state_dict or {}):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or id(sh.data) in out:
            continue
        if isinstance(sh, ShardedTensor):
            out[id(sh.data)] = [(sh, 0)]
            continue
        built = dataclasses.replace(sh, data=torch.empty(sh.data.shape, dtype=torch.float32, device="meta")).build()
        parts = list(nested_values(built if isinstance(built, (dict, list)) else [built]))
        if not all(isinstance(t, ShardedTensor) and t.data.is_contiguous() for t in parts):
            raise NotImplementedError(f"{sh.key}: megatron-core saves it through a factory whose tensors are not "
                                      "contiguous ranges of the parameter; the optimizer state cannot follow it")
        out[id(sh.data)] = [(t, t.data.storage_offset()) for t in parts]
    return out


def state_blocks(tensor: "ShardedTensor", offset: int, flat: torch.Tensor, start: int, key: str,
                 replica: int) -> List["ShardedTensor"]:
    """``flat`` (elements ``[start, start + numel)`` of the flattened parameter) where it meets ``tensor`` (saved from
    ``offset`` on): ShardedTensors ``key``, placed in ``tensor``'s global tensor; ``replica`` 0 writes them."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    n = math.prod(tensor.local_shape)
    lo, hi = max(start, offset), min(start + flat.numel(), offset + n)
    p = tensor.prepend_axis_num
    r = tensor.replica_id
    # (megatron-core's model tensors: (pipeline copy, tensor-parallel copy, DP copy); a plain number, the DP copy)
    replica_id = (*r[:-1], replica) if isinstance(r, tuple) else replica
    out, pos = [], lo - start
    for off, shape in flat_range_blocks(tensor.local_shape, lo - offset, hi - offset):
        # (the prepended axes -- layers stacked -- as axes of size 1: megatron-core 0.16 hands uneven shards to DCP
        # without them)
        data = flat[pos:pos + math.prod(shape)].view((1,) * p + shape)
        pos += data.numel()
        out.append(ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                                 global_shape=tensor.global_shape,
                                 global_offset=(*tensor.global_offset[:p],
                                                *(g + o for g, o in zip(tensor.global_offset[p:], off))),
                                 axis_fragmentations=None, replica_id=replica_id,
                                 allow_shape_mismatch=tensor.allow_shape_mismatch))
    return out


def state_fields(inner: torch.optim.Optimizer) -> List[Tuple[str, str]]:
    """(our name, the checkpoint's) of each per-element tensor: the main weight and the optimizer's moments."""
    from .distributed_optimizer import optimizer_state_keys

    return [("master", "param")] + [(k, k) for k in optimizer_state_keys(inner)]


def sharded_optimizer_state(opt: Any, model_sharded_state_dict: Any, is_loading: bool, metadata: Optional[dict],
                            fields: Optional[List[Tuple[str, str]]] = None) -> Dict[str, Any]:
    """The ODO's ``sharded_state_dict``: collective over the DP group (the step and the check that every piece has
    a model tensor are agreed, so no rank is left in the save while another raised). ``fields``: (ours, the
    checkpoint's name) of the tensors to load, where they are not :func:`state_fields`."""
    if opt.chunks[0].plan.param > 1:
        raise NotImplementedError("dist-checkpointing of a parameter-sharded (ZeRO-3) plan: megatron-core's model "
                                  "sharded_state_dict would see the primary shards, not the weights")
    layout = (metadata or {}).get("distrib_optim_sharding_type")
    if layout not in (None, MEGATRON_LAYOUT):   # (the same on every rank: Megatron-LM's flags, or the checkpoint's)
        raise ValueError(
            f"the overlapped distributed optimizer saves and loads its state in model space "
            f"(distrib_optim_sharding_type {MEGATRON_LAYOUT!r}, Megatron-LM's --dist-ckpt-optim-fully-reshardable), "
            f"not {layout!r}" + (f": this checkpoint's optimizer state is in Megatron's {layout!r} layout, which it "
                                 "does not read" + (" (the Megatron-LM plug-in reads it)" if layout == "dp_reshardable"
                                                    else "") + "; resume with --no-load-optim, or have Megatron's own "
                                 "optimizer load it and save it again with --dist-ckpt-optim-fully-reshardable"
                                 if is_loading else ""))
    opt._settle()
    try:
        tensors = model_tensors(model_sharded_state_dict)
        missing = sorted({pc.name for pc in opt.pieces if id(pc.param) not in tensors})
        problem = (_NO_TENSOR + ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "") + _PASS_THE_MODELS
                   if missing else "")
    except Exception as e:   # noqa: BLE001 - (a factory megatron-core cannot build on a meta tensor): agreed below
        tensors, problem = {}, f"{type(e).__name__}: {e}"
    fields = fields if fields is not None else state_fields(opt.inner)
    moments = [ours for ours, _ in fields if ours != "master"]
    has_state = any(k in st for st in opt.inner.state.values() for k in moments)
    agreed = opt._all_reduce(torch.tensor([float(inner_step(opt.inner)), float(has_state), float(bool(problem))],
                                          dtype=torch.float64, device=opt.grad_device), torch.distributed.ReduceOp.MAX)
    if agreed[2].item() > 0:   # (every rank raises: none is left in the save's first collective)
        raise ValueError(problem or "the optimizer state cannot be placed in the model's sharded_state_dict on "
                         "another rank (nothing was saved or loaded)")
    param_state: Dict[int, Dict[str, List[Any]]] = {}
    for i, pc in enumerate(opt.pieces):
        state = opt.inner.state.get(pc.master, {})
        entry: Dict[str, List[Any]] = {}
        for ours, theirs in fields:
            if is_loading:
                flat = torch.empty(pc.end - pc.start, dtype=torch.float32, device=pc.master.device)
            elif ours == "master" or ours in state:
                flat = (pc.master if ours == "master" else state[ours]).detach().float()
                # megatron-core's writer copies a CUDA tensor to the host before the save returns; a CPU tensor it
                # writes as it is, perhaps after training went on (asynchronous save), so that is copied here
                flat = flat.clone() if flat.device.type == "cpu" else flat
            else:   # no step applied yet: a fresh optimizer's zeros (has_state tells the loader)
                flat = torch.zeros(pc.end - pc.start, dtype=torch.float32, device=pc.master.device)
            entry[theirs] = [b for t, off in tensors[id(pc.param)]
                             for b in state_blocks(t, off, flat, pc.start, PREFIX + f"{theirs}.{t.key}",
                                                   0 if pc.primary else 1)]
        param_state[i] = entry
    shared = opt.shared_state(int(agreed[0].item()))
    return {"format": SHARDED_FORMAT, "update_rule": shared["optimizer"], "step": shared["step"],
            "param_groups": shared["param_groups"], "has_state": bool(agreed[1].item()), **megatron_common(shared),
            "param_state_sharding_type": MEGATRON_LAYOUT, "param_state": param_state}


def megatron_common(shared: Dict[str, Any]) -> Dict[str, Any]:
    """What Megatron's DistributedOptimizer's ``load_state_dict`` reads beside the tensors, from the ODO's shared
    state ``shared``: ``"optimizer"``, its ``state_dict()`` (the inner optimizer's param groups without their
    parameters, each with the step, as megatron-core writes it for torch's Adam and for the fused ones; the groups
    are matched by megatron-core's identifier keys, ``wd_mult``, ``lr_mult``, ``is_expert_parallel`` and
    ``is_decoupled_lr``, which the ODO's groups carry as megatron-core builds them), and ``"grad_scaler"``, whose
    scale megatron-core's dynamic scaler restores as a tensor (the ODO's scalers read either). Under
    ``--decoupled-lr`` megatron-core 0.16.1's default and decoupled groups have the same identifier keys, so its
    ``load_state_dict`` gives both the same saved group, from its own checkpoints as from these."""
    # (torch's Adam corrects the bias always; the fused ones read whether to, and torch's load_state_dict hands
    # them the saved group as it is)
    groups = [{"bias_correction": True, **{k: v for k, v in g.items() if k != "overrides"}, "step": shared["step"]}
              for g in shared["param_groups"]]
    scaler = shared["grad_scaler"]
    if scaler is not None:
        scaler = {**scaler, "scale": torch.tensor([float(scaler["scale"])])}
    return {"optimizer": {"param_groups": groups}, "grad_scaler": scaler}


def sharded_header(saved: Dict[str, Any]) -> Dict[str, Any]:
    """The ODO's own header of a saved sharded state of any version (update rule under ``"optimizer"``, as the
    other checkpoint layouts have it; step, param groups, loss scaler, whether the optimizer had state)."""
    rule = saved["optimizer"] if saved["format"] != SHARDED_FORMAT else saved["update_rule"]
    scaler = saved.get("grad_scaler")
    if scaler is not None:
        scaler = {**scaler, "scale": float(scaler["scale"])}
    return {"optimizer": rule, "step": int(saved["step"]), "param_groups": saved["param_groups"],
            "grad_scaler": scaler, "has_state": saved.get("has_state", int(saved["step"]) > 0)}


def local_state(opt: Any, loaded: Dict[str, Any], header: Dict[str, Any],
                fields: Optional[List[Tuple[str, str]]] = None) -> Dict[str, Any]:
    """The loaded blocks of this rank's pieces (``loaded["param_state"]``, as :func:`sharded_optimizer_state` asked
    for them) as the ODO's rank-local state dict, with ``header``'s step, update rule, param groups and loss scaler.
    Saved before the optimizer had state (``has_state``; else judged by the step): the main weights alone, as a
    fresh optimizer starts. ``fields``: as they were asked for; where ``master`` is not among them, the main weights
    are the weights (an fp32 model's)."""
    fields = fields if fields is not None else state_fields(opt.inner)
    if not header.get("has_state", int(header["step"]) > 0):
        fields = [f for f in fields if f[0] == "master"]
    params = {}
    for i, pc in enumerate(opt.pieces):
        shape = opt.chunks[pc.chunk].param_shape(pc.param)
        entry = {"shape": tuple(shape), "numel": shape.numel(), "start": pc.start, "end": pc.end}
        for ours, theirs in fields:
            entry[ours] = torch.cat([b.reshape(-1) for b in loaded["param_state"][i][theirs]])
        if "master" not in entry:
            entry["master"] = pc.param.detach().reshape(-1)[pc.start:pc.end].float()
        params[pc.name] = entry
    topology = opt.chunks[0].topology
    return {"format": LOCAL_FORMAT, "dp_size": topology.size, "dp_rank": topology.rank,
            "optimizer": header["optimizer"], "step": int(header["step"]), "param_groups": header["param_groups"],
            "grad_scaler": header.get("grad_scaler"), "params": params}
