"""Megatron's DistributedOptimizer state in a torch_dist checkpoint, read as pretrain_gpt's canonical optimizer state.

[Note: the two layouts]
Megatron-LM saves its distributed optimizer's Adam state in one of two layouts (``param_state_sharding_type`` in
``common.pt``), both read here:

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
  syncs them before saving), element for element. The registration order is tried first, then every parameter of
  the position not yet placed; one that fits nowhere, or a bucket left with elements no parameter explains, refuses
  the import, naming the bucket, so the state is either carried exactly or not at all. (Two parameters of one size
  whose weights are equal element for element are told apart by the registration order alone.)

The step comes from the optimizer's param groups (the same on every position), and the groups' hyper-parameters
(``lr``, ``weight_decay``, ``wd_mult``, ...) are kept as pretrain_gpt's loader matches them (by ``wd_mult`` and
``lr_mult``). Only Adam is read, and a loss scaler's state (fp16) is not: the resumed run's scaler starts afresh.
Megatron's non-distributed optimizers and the other (deprecated) layouts are refused by name: resume those with
``--no-load-optim``.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..optimizer.checkpoint import CANONICAL_FORMAT
from .checkpointing import CheckpointError

LAYOUTS = ("dp_reshardable", "fully_reshardable")
_FIELDS = (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))   # (ours, Megatron's)
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                     r"\.param$")
_ALIGN = 64   # megatron-core's _ParamAndGradBuffer: a parameter starts at a multiple of 64 elements


def saved_layout(saved: Dict[str, Any]) -> Tuple[Optional[str], str]:
    """(the layout of Megatron's optimizer state this import reads, or None; why not, for the log)."""
    optimizer = saved.get("optimizer")
    if not isinstance(optimizer, dict):
        return None, "saved without optimizer state"
    layout = optimizer.get("param_state_sharding_type")
    if layout is None:
        return None, "Megatron's non-distributed optimizer state is not read"
    if layout not in LAYOUTS:
        return None, f"Megatron's {layout} optimizer layout is not read (only {' and '.join(LAYOUTS)})"
    return layout, ""


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
        groups = groups.get("optimizer", groups).get("param_groups") if isinstance(groups, dict) else None
        if not groups:
            raise CheckpointError(f"{src.ckpt}: Megatron's optimizer state without its param groups")
        steps = {int(g["step"]) for g in groups if "step" in g}
        if len(steps) != 1:
            raise CheckpointError(f"{src.ckpt}: the optimizer's param groups give the steps {sorted(steps)}, not one")
        self.header = {"format": CANONICAL_FORMAT, "optimizer": "AdamW", "step": steps.pop(),
                       "param_groups": [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups],
                       "grad_scaler": None}
        if layout == "fully_reshardable":
            missing = [f"optimizer.state.{theirs}.{key}" for key in src.stored_keys() for _, theirs in _FIELDS
                       if not src.has_stored(f"optimizer.state.{theirs}.{key}")]
            if missing:
                raise CheckpointError(f"{src.ckpt}: fully_reshardable optimizer state without {missing[0]} (only "
                                      "Adam's state is read)")

    def shard(self, stage: int, chunk: int, key: str, stored: str, tp: int, rank: int, swiglu: bool
              ) -> Dict[str, torch.Tensor]:
        """TP rank ``rank``'s (master, exp_avg, exp_avg_sq) of the parameter ``key`` of (stage, chunk), in its
        shape; ``stored``: its name in the checkpoint (a tied output layer's is the embedding's)."""
        if self.layout == "fully_reshardable":
            return {ours: self.src.model_shard(stored, tp, rank, swiglu, prefix=f"optimizer.state.{theirs}.")
                    for ours, theirs in _FIELDS}
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
                         for k in self.src.stored_keys("optimizer.") if (m := _BUCKET.match(k))
                         and int(m.group(1)) == group)
        if not buckets:
            raise CheckpointError(f"{self.src.ckpt}: no optimizer buckets for TP rank {rank}, stage {stage} "
                                  f"(dp_group_idx_{group})")
        weights = {}   # (chunk, key) -> this position's weight, flat
        for s, c, key, g in self._positions:
            if s == stage:
                weights[c, key] = self.src.model_shard(self.src.stored_name(g), tp, rank, swiglu)
        order = list(weights)   # registration order: the walk expects its reverse
        out: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
        for _, _, prefix in buckets:
            fields = {ours: self.src.read_flat(f"{prefix}.{theirs}") for ours, theirs in _FIELDS}
            main, end, offset = fields["master"], fields["master"].numel(), 0
            expected = [p for p in reversed(order) if p not in out]
            while True:
                offset = -(-offset // _ALIGN) * _ALIGN
                if offset >= end:
                    break
                found = _place(main, offset, end, expected, weights)
                if found is None:
                    raise CheckpointError(
                        f"{self.src.ckpt}: {prefix}: no parameter of TP rank {rank}, stage {stage} has the main "
                        f"weights at element {offset} of {end} (not megatron-core's bucket layout, or weights and "
                        "optimizer from two saves): resume with --no-load-optim")
                n = weights[found].numel()
                shape = weights[found].shape
                out[found] = {ours: t[offset:offset + n].reshape(shape).clone() for ours, t in fields.items()}
                expected.remove(found)
                offset += n
        missing = [k for k in order if k not in out]
        if missing:
            raise CheckpointError(f"{self.src.ckpt}: no optimizer state for {missing[0][1]} (TP rank {rank}, stage "
                                  f"{stage}) in its buckets: resume with --no-load-optim")
        return out


def _place(main: torch.Tensor, offset: int, end: int, expected: List[Tuple[int, str]],
           weights: Dict[Tuple[int, str], torch.Tensor]) -> Optional[Tuple[int, str]]:
    """The parameter whose weight is the main weights at ``offset`` (cast to its dtype): the next one in
    ``expected`` order if it is, else the first in that order that is."""
    def fits(p: Tuple[int, str]) -> bool:
        w = weights[p].reshape(-1)
        n = w.numel()
        return offset + n <= end and torch.equal(main[offset:offset + n].to(w.dtype), w)

    if expected and fits(expected[0]):
        return expected[0]
    head = main[offset:offset + 8]
    for p in expected:   # the first elements rule most out before a whole comparison
        w = weights[p].reshape(-1)
        if torch.equal(head[:w.numel()].to(w.dtype), w[:head.numel()]) and fits(p):
            return p
    return None
