"""Megatron's DistributedOptimizer's ``dp_reshardable`` state, read by the plug-in's ODO from a torch_dist checkpoint.

[Note: reading bucket space]
``dp_reshardable`` is what Megatron-LM saves with ``--use-distributed-optimizer`` and its default ``--ckpt-format
torch_dist``. Each TP x PP position (``dp_group_idx_<g>``, ``g`` its rank in megatron-core's model-parallel group)
stores, per gradient buffer (one per model chunk and dtype) and bucket, one flat tensor per state (``param``, the fp32
main weight; ``exp_avg``; ``exp_avg_sq``) of the bucket's unpadded size, and its param groups as an object. Which
parameter lies where is not stored. megatron-core's ``_ParamAndGradBuffer`` lays a buffer's parameters out in
reverse registration order, each from the next multiple of 64 elements; a bucket closes after the parameter that
fills it to the bucket size, or (a shared embedding) before a parameter at the 64-aligned end of the last one. So the
stored buckets' sizes and the live model's registration order and shapes give every parameter's place
(:func:`bucket_offsets`): the walk must end each bucket exactly at its size, or the layout is not megatron-core's for
this model and nothing is read.

Each rank then reads only its own pieces' ranges (12 bytes per element it owns, through DCP from the stored chunks
they overlap), and checks them: its main weights, cast to the weight's dtype, must equal the weights Megatron-LM has
just loaded. Every element of every parameter is some rank's, so every placement is checked on some rank; the caller
agrees on the outcome across ranks before anything is loaded. Parameters of one size that hold the same values (layer
norms still at 1.0) pass that check in each other's places: there the registration order alone places them, as it
does megatron-core, which is right as long as the saving and the resuming model register their parameters alike.

Megatron-LM hands the optimizer only the loaded state, not where it came from: :func:`install_load_recorder` (run by
the plug-in's ``install()``) wraps ``dist_checkpointing`` as Megatron-LM's checkpointing module sees it, so that its
``load`` notes the checkpoint directory (:func:`last_loaded_dir`).
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from megatron_ext.training.checkpoint_import_optim import BUCKET_KEY, PARAM_ALIGN, is_main_of

_LOADED: Dict[str, str] = {}


class BucketLayoutError(ValueError):
    """The stored buckets are not megatron-core's layout of this model's parameters."""


def bucket_offsets(params: Sequence[Tuple[Hashable, int]], sizes: Sequence[int]) -> Dict[Hashable, Tuple[int, int]]:
    """``{param: (bucket, offset)}`` for ``params`` ((key, numel) in the order they lie: reverse registration) in
    buckets of ``sizes`` elements (see the module note)."""
    out: Dict[Hashable, Tuple[int, int]] = {}
    bucket, offset = 0, 0
    for key, numel in params:
        at = -(-offset // PARAM_ALIGN) * PARAM_ALIGN
        if offset and bucket < len(sizes) and at == sizes[bucket]:   # closed before this one (a shared embedding)
            bucket, at = bucket + 1, 0
        if bucket >= len(sizes) or at + numel > sizes[bucket]:
            where = f"bucket {bucket} of {sizes[bucket]} elements" if bucket < len(sizes) else \
                f"a bucket after the last ({len(sizes)})"
            raise BucketLayoutError(f"{key} ({numel} elements) would lie at element {at} of {where}")
        out[key] = (bucket, at)
        offset = at + numel
        if offset == sizes[bucket]:
            bucket, offset = bucket + 1, 0
    if bucket != len(sizes) or offset:
        raise BucketLayoutError(f"the parameters fill {bucket} of {len(sizes)} buckets"
                                + (f" and {offset} elements of the next" if offset else ""))
    return out


def read_bucket_state(opt: Any, ckpt: str, group_idx: int, args: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's pieces of Megatron's ``dp_reshardable`` state at ``ckpt`` (position ``dp_group_idx_<group_idx>``)
    as the ODO's rank-local state dict, placed and checked as the module note says. ``opt``: the plug-in's ODO, whose
    live weights Megatron-LM has just loaded; ``args``: what its param groups are keyed by (``canonical_header``).
    Raises ValueError (or CheckpointError) naming what does not fit."""
    from megatron_ext.optimizer.dist_checkpoint import local_state, state_fields
    from megatron_ext.training.checkpoint_import_dist import TorchDistFiles
    from megatron_ext.training.checkpoint_import_optim import canonical_header

    files = TorchDistFiles(ckpt)
    prefix = f"optimizer.distributed.dp_group_idx_{group_idx}"
    buckets: Dict[int, Dict[str, List[Tuple[int, str]]]] = {}
    for key in files.stored_keys(prefix + "."):
        m = BUCKET_KEY.match(key)
        if m and int(m.group(1)) == group_idx:
            buckets.setdefault(int(m.group(2)), {}).setdefault(m.group(3), []).append(
                (int(m.group(4)), key[: -len(".param")]))
    chunks, order, cut = opt._saved_names()
    if sorted(buckets) != list(range(len(chunks))) or any(len(b) != 1 for b in buckets.values()):
        raise ValueError(f"{prefix} holds gradient buffers {sorted(buckets)} of dtypes "
                         f"{[sorted(b) for _, b in sorted(buckets.items())]}, not one per model chunk "
                         f"({len(chunks)}) of one dtype")
    fields = state_fields(opt.inner)
    place: Dict[Tuple[int, str], Tuple[str, int]] = {}   # (chunk, name) -> (bucket key, offset)
    for c in range(len(chunks)):
        (stored,) = buckets[c].values()
        stored.sort()
        if [b for b, _ in stored] != list(range(len(stored))):
            raise ValueError(f"{prefix}.gbuf_idx_{c}: buckets {[b for b, _ in stored]} are not 0..{len(stored) - 1}")
        for _, key in stored:
            missing = [theirs for _, theirs in fields if not files.has_stored(f"{key}.{theirs}")]
            if missing:
                raise ValueError(f"{key} has no {missing[0]} (only the state of this run's optimizer, "
                                 f"{type(opt.inner).__name__}, is read)")
        sizes = [files.stored_shape(f"{key}.param")[0] for _, key in stored]
        mine = [(c, name) for cc, name in reversed(order) if cc == c]
        try:
            offsets = bucket_offsets([(p, chunks[p[0]][p[1]].numel()) for p in mine], sizes)
        except BucketLayoutError as e:
            raise ValueError(f"{prefix}.gbuf_idx_{c}: not megatron-core's bucket layout of this model chunk's "
                             f"parameters in their registration order: {e}") from None
        place.update({p: (stored[b][1], at) for p, (b, at) in offsets.items()})
    scaler = f"{prefix}.grad_scaler"
    header = canonical_header(files.read_object(f"{prefix}.optimizer"), ckpt,
                              files.read_object(scaler) if files.has_object(scaler) else None, args)
    name_of = {id(p): (ci, c.param_names[id(p)][len(cut):]) for ci, c in enumerate(opt.chunks)
               for p in c.module.parameters() if id(p) in c.param_names}
    spans: Dict[str, List[Tuple[int, int]]] = {}
    where: List[Tuple[str, int, str]] = []   # per piece: (bucket key, offset of the piece, name)
    for pc in opt.pieces:
        ci, name = name_of[id(pc.param)]
        key, at = place[ci, name]
        where.append((key, at + pc.start, name))
        for _, theirs in fields:
            spans.setdefault(f"{key}.{theirs}", []).append((at + pc.start, at + pc.end))
    read = {k: iter(v) for k, v in files.read_ranges(spans).items()}   # (in the order asked for)
    loaded: Dict[int, Dict[str, List[torch.Tensor]]] = {}
    for i, (pc, (key, at, name)) in enumerate(zip(opt.pieces, where)):
        loaded[i] = {theirs: [next(read[f"{key}.{theirs}"])] for _, theirs in fields}
        weight = pc.param.detach().reshape(-1)[pc.start:pc.end]
        if not is_main_of(loaded[i]["param"][0], weight):
            raise ValueError(f"the main weights at {key} (elements {at}..{at + pc.end - pc.start}) are not "
                             f"{name}'s weights: not megatron-core's bucket layout of this model, or weights and "
                             "optimizer state from two saves")
    return local_state(opt, {"param_state": loaded}, header, fields)


class _RecordingDistCheckpointing:
    """``megatron.core.dist_checkpointing`` whose ``load`` notes the directory it reads (see the module note)."""

    def __init__(self, module: Any) -> None:
        self.wrapped = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        _LOADED["dir"] = str(checkpoint_dir)
        return self.wrapped.load(sharded_state_dict, checkpoint_dir, *args, **kwargs)


def install_load_recorder(checkpointing_module: Any) -> Optional[Any]:
    """Have ``checkpointing_module`` (Megatron-LM's ``megatron.training.checkpointing``) load torch_dist
    checkpoints through the recorder; returns what it had, for :func:`uninstall_load_recorder` (None: nothing)."""
    original = getattr(checkpointing_module, "dist_checkpointing", None)
    if original is None or isinstance(original, _RecordingDistCheckpointing):
        return None
    checkpointing_module.dist_checkpointing = _RecordingDistCheckpointing(original)
    return original


def uninstall_load_recorder(checkpointing_module: Any, original: Any) -> None:
    checkpointing_module.dist_checkpointing = original
    _LOADED.clear()


def recording(module: Any) -> Any:
    """``module`` (megatron-core's ``dist_checkpointing``) as the recorder wraps it (tests load through this)."""
    return _RecordingDistCheckpointing(module)


def last_loaded_dir() -> Optional[str]:
    """The directory of the last torch_dist checkpoint Megatron-LM loaded through the recorder, if any."""
    return _LOADED.get("dir")
