"""Optimizer checkpoints in canonical layout: per parameter name, in the flattened parameter's coordinates.

A rank-local state (``OverlappedDistributedOptimizer.state_dict()``) holds the slices ``[start, end)`` the rank
owns. :func:`merge_optimizer_shards` stitches the slices of all DP ranks into full per-parameter tensors (and
checks that every element is covered exactly once), which loads at any DP size, bucket size, backend or sharding
plan. Under a plan with replicated optimizer shards only replica 0's slices are taken (the replicas are
bit-identical).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

LOCAL_FORMAT = "megatron_ext.odo/1"
CANONICAL_FORMAT = "megatron_ext.odo/1-canonical"


def merge_optimizer_shards(shards: List[dict]) -> dict:
    """Merge the rank-local state dicts of one DP group into the canonical, unsharded form."""
    if not shards:
        raise ValueError("merge_optimizer_shards: no shards given")
    for s in shards:
        if s.get("format") != LOCAL_FORMAT:
            raise ValueError(f"merge_optimizer_shards: expected format {LOCAL_FORMAT!r}, got {s.get('format')!r}")
    dp_sizes = {s["dp_size"] for s in shards}
    ranks = sorted(s["dp_rank"] for s in shards)
    if len(dp_sizes) != 1 or ranks != list(range(dp_sizes.pop())):
        raise ValueError(f"merge_optimizer_shards: incomplete set of DP shards (ranks {ranks})")
    meta = shards[0]["all_params"]
    params: Dict[str, dict] = {}
    covered: Dict[str, torch.Tensor] = {}
    for name, (shape, numel) in meta.items():
        params[name] = {"shape": tuple(shape), "numel": numel}
        covered[name] = torch.zeros(numel, dtype=torch.int32)
    for s in shards:
        if s.get("replica", 0) != 0:
            continue
        for name, entry in s["params"].items():
            if name not in params:
                raise ValueError(f"merge_optimizer_shards: parameter {name!r} not in the shard metadata")
            a, e = entry["start"], entry["end"]
            covered[name][a:e] += 1
            for k, v in entry.items():
                if torch.is_tensor(v):
                    full = params[name].setdefault(k, torch.zeros(params[name]["numel"], dtype=v.dtype))
                    full[a:e] = v
    for name, cov in covered.items():
        if not bool((cov == 1).all()):
            bad = (cov != 1).nonzero()
            raise ValueError(f"merge_optimizer_shards: parameter {name!r} elements {bad[0].item()}.. are covered "
                             f"{cov[bad[0]].item()} times (expected exactly once): shards are inconsistent")
    first = shards[0]
    return {"format": CANONICAL_FORMAT, "optimizer": first["optimizer"], "step": max(s["step"] for s in shards),
            "param_groups": first["param_groups"], "grad_scaler": first["grad_scaler"], "params": params}


def canonical_entry(state: Dict[str, torch.Tensor]) -> dict:
    """One parameter's entry in the canonical layout from its state tensors in the parameter's shape (master, the
    optimizer's per-element state): the shape, the element count and each tensor flattened."""
    shape = next(iter(state.values())).shape
    return {"shape": tuple(shape), "numel": shape.numel(), **{k: v.reshape(-1) for k, v in state.items()}}


def to_cpu(obj: Any) -> Any:
    """A copy of a (nested) state with every tensor on the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def write_canonical_optimizer_state(local_state: dict, path: str, dp_group: Optional[dist.ProcessGroup] = None,
                                    save: Optional[Callable[[Any, str], None]] = None) -> bool:
    """Collective over ``dp_group``: every DP rank writes its rank-local state next to ``path``, then DP rank 0
    merges the shards from disk into the canonical file ``path`` and removes them. Atomicity of the checkpoint as a
    whole is the caller's (pretrain_gpt writes into a temporary directory; Megatron-LM updates its tracker last).

    Going through files keeps the optimizer state off the network and out of GPU memory (``gather_object`` would
    pickle every rank's state into device buffers under NCCL); the merge maps the shards (``mmap``), so rank 0
    holds one canonical copy, not P shards plus the copy. Returns True on the rank that wrote ``path``.
    """
    save = save or (lambda obj, p: torch.save(obj, p))
    rank, size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    shard_dir = path + ".shards"
    os.makedirs(shard_dir, exist_ok=True)
    save(to_cpu(local_state), os.path.join(shard_dir, f"dp_{rank:05d}.pt"))
    dist.barrier(group=dp_group)
    if rank != 0:
        return False
    shards = [torch.load(os.path.join(shard_dir, f"dp_{r:05d}.pt"), map_location="cpu", weights_only=False,
                         mmap=True) for r in range(size)]
    save(merge_optimizer_shards(shards), path)
    del shards
    shutil.rmtree(shard_dir)
    return True


def state_slice(state_dict: dict, name: str, key: str, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of ``name``'s ``key`` state from a canonical or rank-local state dict."""
    params = state_dict["params"]
    if name not in params:
        raise KeyError(f"optimizer checkpoint has no state for parameter {name!r}")
    entry = params[name]
    if key not in entry:
        raise KeyError(f"optimizer checkpoint has no {key!r} state for parameter {name!r}")
    t = entry[key]
    if state_dict["format"] == CANONICAL_FORMAT:
        if t.numel() != entry["numel"]:
            raise ValueError(f"checkpoint state {key!r} of {name!r} has {t.numel()} elements, "
                             f"expected {entry['numel']}")
        return t[start:end]
    if (entry["start"], entry["end"]) != (start, end):
        raise ValueError(f"rank-local checkpoint slice of {name!r} is [{entry['start']}, {entry['end']}), "
                         f"this rank owns [{start}, {end}): merge the shards to reshard")
    return t
