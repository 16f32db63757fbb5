"""Optimizer checkpoints in canonical layout: per parameter name, in the flattened parameter's coordinates.

A rank-local state (``OverlappedDistributedOptimizer.state_dict()``) holds the slices ``[start, end)`` the rank
owns. :func:`merge_optimizer_shards` stitches the slices of all DP ranks into full per-parameter tensors (and
checks that every element is covered exactly once), which loads at any DP size, bucket size or backend.
"""
from __future__ import annotations

from typing import Dict, List

import torch

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
