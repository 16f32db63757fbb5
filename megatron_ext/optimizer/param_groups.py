"""Param groups as megatron-core builds them: ``config_overrides`` ({ParamKey: ParamGroupOverride}) per parameter.

megatron-core's ``get_megatron_optimizer(config, model_chunks, config_overrides=...)`` matches every trainable
parameter (by its name in the model chunk, an attribute or a predicate) against the overrides' keys, merges the
overrides that match (conflicting values are an error) and puts parameters with the same merged override into one
group; ``None`` means its standard overrides (no weight decay for biases and 1-D parameters, ``--decoupled-lr`` /
``--decoupled-min-lr`` for the embedding and output layer). The ODO uses the same functions on the same names (the
chunk's ``named_parameters()``: ``module.`` first, as under megatron-core's DDP), so a Megatron-LM run groups alike
with either optimizer. A group holds this rank's slices (``_Piece.master``) of the matched parameters, and every
rank has every group (empty ones included) in the same order: None first, then the overrides sorted, as
megatron-core orders them.

Each group records its key under ``"overrides"``: a checkpoint's groups are matched to this run's by it, so a
reordering (or an older checkpoint, whose two default groups came in the other order) never swaps hyper-parameters
between groups.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence

import torch

GroupKey = Optional[tuple]


def group_key_of_params(config, chunks: Sequence[Any], config_overrides: Optional[dict]) -> Dict[int, GroupKey]:
    """``id(param) -> key`` (megatron-core's merged ``ParamGroupOverride`` as a sorted tuple, None for none)."""
    from megatron.core.optimizer import (combine_param_group_overrides, get_standard_config_overrides,
                                         param_group_override_to_tuple)

    overrides = get_standard_config_overrides(config) if config_overrides is None else config_overrides
    keys: Dict[int, GroupKey] = {}
    for c in chunks:
        for name, p in c.named_parameters():
            if not p.requires_grad or id(p) not in c.param_names:
                continue
            # under ZeRO-3 a released bucket's parameters keep their shapes (only the storage is freed)
            matched = [o for k, o in overrides.items() if k.matches(p, name)]
            if not matched:
                keys[id(p)] = None
                continue
            try:
                merged = combine_param_group_overrides(matched)
            except ValueError as e:
                raise ValueError(f"config_overrides: parameter {name!r}: {e}") from e
            if "params" in merged:
                raise ValueError("config_overrides: 'params' is not an override key (megatron-core's rule)")
            keys[id(p)] = param_group_override_to_tuple(merged)
    return keys


def build_param_groups(config, keys: Dict[int, GroupKey], pieces: Sequence[Any]) -> List[dict]:
    """The inner optimizer's groups over this rank's ``pieces``; every key gets a group, empty or not."""
    order = sorted(set(keys.values()), key=_key_order)
    members: Dict[GroupKey, List[torch.nn.Parameter]] = {k: [] for k in order}
    for pc in pieces:
        members[keys[id(pc.param)]].append(pc.master)
    groups = []
    for k in order:
        override = dict(k or ())
        group = {"params": members[k], "is_expert_parallel": False,
                 "default_config": not any("lr" in name for name in override),
                 "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
                 "max_lr": config.lr, "min_lr": config.min_lr, **override, "overrides": k}
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
        groups.append(group)
    return groups


def describe_groups(names: Dict[int, str], keys: Dict[int, GroupKey]) -> str:
    """What all DP ranks must agree on: each group's key and the parameters matched into it (by name)."""
    import zlib

    by_key: Dict[GroupKey, List[str]] = {}
    for pid, k in keys.items():
        by_key.setdefault(k, []).append(names[pid])
    return "; ".join(f"{k!r}: {len(v)} params (crc {zlib.crc32(','.join(sorted(v)).encode())})"
                     for k, v in sorted(by_key.items(), key=lambda kv: _key_order(kv[0])))


def match_saved_groups(saved: List[dict], groups: List[dict]) -> List[Optional[dict]]:
    """For each of this run's groups, the saved group with the same key (None: none). Checkpoints without keys
    (written before the keys were recorded) are matched by ``(wd_mult, lr_mult)`` when that is unambiguous, else by
    position when the counts agree."""
    def identity(g: dict, keyed: bool) -> Hashable:
        return g.get("overrides") if keyed else (g.get("wd_mult"), g.get("lr_mult"))

    keyed = bool(saved) and all("overrides" in g for g in saved)
    table: Dict[Hashable, dict] = {}
    for g in saved:
        table.setdefault(identity(g, keyed), g)
    if keyed or len(table) == len(saved):
        return [table.get(identity(g, keyed)) for g in groups]
    return list(saved) if len(saved) == len(groups) else [None] * len(groups)


def _key_order(k: GroupKey) -> tuple:
    """megatron-core's group order: no override first, then the overrides sorted."""
    return (k is not None, k or ())


def logged_lr(groups: List[dict]) -> float:
    """The learning rate to log: the first group on the default schedule (megatron-core's rule), else the first."""
    return next((g["lr"] for g in groups if g.get("default_config", True)), groups[0]["lr"])
