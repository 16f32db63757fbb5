"""The ODO's collectives outside the backends: scalar reductions and model-parallel gradient all-reduces.

[Note: device]
A process group reduces only tensors on a device its backend serves: NCCL only CUDA tensors, a ``"cpu:gloo"`` group
only CPU tensors. Scalars (inf flag, grad norm, zero count, step) are computed where the gradients live and moved
to a device the group accepts only when that differs, so the same code runs on CPU/gloo and CUDA/NCCL. A group that
serves neither the preferred device nor CUDA/CPU is rejected with a clear error instead of failing inside the
collective.

[Note: ledger]
Each of these collectives is recorded under its own name, so a run's report separates them from the bucket
traffic: ``dp_scalar_all_reduce`` (DP group), ``mp_scalar_all_reduce`` and ``mp_grad_all_reduce`` (model-parallel
groups: TP / PP / embedding). An all-reduce of B bytes over P ranks is counted as a rank sending 2B/P to each of its
P-1 peers (reduce-scatter then all-gather). Link classes come from the DP topology for the DP group; for a
model-parallel group a peer is on the same node when its global rank is in the same block of LOCAL_WORLD_SIZE ranks.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm.ledger import CommLedger

DP_SCALAR = "dp_scalar_all_reduce"
MP_SCALAR = "mp_scalar_all_reduce"
MP_GRAD = "mp_grad_all_reduce"


def device_types_from_backend(backend: str) -> FrozenSet[str]:
    """Device types a backend string serves: ``"nccl"`` -> {cuda}, ``"cpu:gloo,cuda:nccl"`` -> {cpu, cuda}."""
    backend = str(backend).lower()
    if ":" in backend:
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(",") if ":" in part)
    known = dist.Backend.backend_capability.get(backend)
    if known is None:
        raise ValueError(f"unknown process-group backend {backend!r}: cannot tell which devices it reduces")
    return frozenset(known)


def group_device_types(group: Optional[dist.ProcessGroup]) -> FrozenSet[str]:
    group = group if group is not None else dist.group.WORLD
    types = getattr(group, "_device_types", None)  # the devices that have a backend registered on this group
    if types:
        return frozenset(d.type for d in types)
    return device_types_from_backend(dist.get_backend(group))


def choose_device(types: Iterable[str], preferred: torch.device, cuda_index: Optional[int]) -> torch.device:
    """``preferred`` when the group serves it, else the current CUDA device, else CPU (pure; unit-tested)."""
    types = frozenset(types)
    if preferred.type in types:
        return preferred
    if "cuda" in types and cuda_index is not None:
        return torch.device("cuda", cuda_index)
    if "cpu" in types:
        return torch.device("cpu")
    raise ValueError(f"the process group reduces tensors on {sorted(types)} only, but the values live on "
                     f"{preferred} and no such device is usable here")


def collective_device(group: Optional[dist.ProcessGroup], preferred: torch.device) -> torch.device:
    """The device on which ``group`` can reduce a tensor that lives on ``preferred``."""
    cuda_index = None
    if torch.cuda.is_available():
        cuda_index = torch.cuda.current_device()
    return choose_device(group_device_types(group), torch.device(preferred), cuda_index)


_ranks_per_node: Optional[int] = None


def set_ranks_per_node(ranks_per_node: Optional[int]) -> None:
    """Processes per node for this process's world, when the launcher's LOCAL_WORLD_SIZE is not the layout to count
    by: pretrain_gpt's ``--ranks-per-node`` simulating nodes on one machine. None: LOCAL_WORLD_SIZE again."""
    global _ranks_per_node
    if ranks_per_node is not None and ranks_per_node <= 0:
        raise ValueError(f"ranks per node must be positive, got {ranks_per_node}")
    _ranks_per_node = ranks_per_node


def node_peers(group: dist.ProcessGroup) -> Tuple[int, int]:
    """(same-node peers, other-node peers) of this rank in ``group``, nodes being blocks of ``set_ranks_per_node``'s
    count, else of LOCAL_WORLD_SIZE (the ledger's intra/inter split of model-parallel reductions)."""
    ranks = dist.get_process_group_ranks(group)
    per_node = _ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or dist.get_world_size()
    me = dist.get_rank() // per_node
    intra = sum(1 for r in ranks if r // per_node == me) - 1
    return intra, len(ranks) - 1 - intra


def all_reduce_(t: torch.Tensor, op, group: dist.ProcessGroup, ledger: Optional[CommLedger], name: str,
                peers: Tuple[int, int], device: Optional[torch.device] = None) -> torch.Tensor:
    """All-reduce ``t`` in place over ``group`` (on ``device`` when given and different), recorded in ``ledger``."""
    size = dist.get_world_size(group)
    if size == 1:
        return t
    if ledger is not None:
        ledger.record_pairwise(name, math.ceil(2 * t.numel() * t.element_size() / size), *peers)
    device = device if device is not None else collective_device(group, t.device)
    if device == t.device:
        dist.all_reduce(t, op=op, group=group)
        return t
    moved = t.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return t.copy_(moved)


def dataclass_fields(config: Any) -> Dict[str, str]:
    """``repr`` of each field of a config dataclass whose value is plain data (callables and objects left out):
    what every DP rank must agree on."""
    import dataclasses

    if not dataclasses.is_dataclass(config):
        return {}
    plain = (bool, int, float, str, type(None), tuple)
    return {f.name: repr(v) for f in dataclasses.fields(config)
            if isinstance(v := getattr(config, f.name), plain) or dataclasses.is_dataclass(v)}


def agree_on_setup(fields: Dict[str, str], group: Optional[dist.ProcessGroup], who: str, what: str) -> None:
    """One all-reduce over ``group`` (None: the world) before a wrapper's first real collective, after its local
    checks passed (a rank whose check fails raises at once, before any collective): whether every rank has the same
    ``fields`` of its config ``what``. A differing backend, plan or bucket size would pair mismatched collectives (a
    hang, or gloo aborting the process); a differing learning rate would train each shard with its rank's value.
    Then every rank raises naming the fields. A peer that failed its own checks and exited breaks the all-reduce:
    named as such instead of gloo's connection error."""
    import zlib

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    h = float(zlib.crc32(repr(sorted(fields.items())).encode()))
    t = torch.tensor([h, -h], dtype=torch.float64, device=collective_device(group, torch.device("cpu")))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        raise RuntimeError(f"{who}: a data-parallel peer stopped before the first collective (its own error says "
                           f"why, e.g. a check that failed there only): {e}") from e
    if t[0].item() != -t[1].item():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, fields, group=group)
        diffs = [f"{k} {v} on DP rank {r}, {everyone[0].get(k)} on rank 0" for r, other in enumerate(everyone)
                 for k, v in other.items() if everyone[0].get(k) != v]
        raise ValueError(f"{who}: the data-parallel ranks have different {what} values ({'; '.join(diffs[:4])}): "
                         "every DP rank must use the same")
