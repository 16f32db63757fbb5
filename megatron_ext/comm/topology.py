"""Topology of the data-parallel group: which ranks share a node, and the subgroups hierarchical backends use.

Nodes are contiguous blocks of ``ranks_per_node`` ranks of the DP group (the layout torchrun and Slurm give).
On one machine, a ``ranks_per_node`` smaller than the group size simulates several nodes, so every hierarchical
path runs in tests. Subgroups are created eagerly and collectively at construction, on every rank, in the same
order (``torch.distributed.new_group`` is itself a collective over the default group).

[Note: ranks_per_node counts DP-group ranks]
``ranks_per_node`` is the number of *this DP group's* ranks on one node, not the number of processes per node: with
TP x DP a node of R processes holds only R / TP members of each DP group. Callers holding a physical per-node count
convert it first -- :func:`group_members_per_node` does so from the group's global ranks (megatron_ext's pretrain_gpt
converts ``--ranks-per-node`` likewise). A value larger than the group, or one that does not divide it, is an error
(it cannot describe how this group sits on nodes). Left unset, it is derived from torchrun's ``LOCAL_WORLD_SIZE``;
when that places the group unevenly (or interleaved) on nodes, the group is treated as one node and DP rank 0 says
so in the log; without ``LOCAL_WORLD_SIZE`` the group is one node.
"""
from __future__ import annotations

import copy
import datetime
import logging
import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Topology:
    """DP group plus its node-local (``intra_group``) and cross-node (``inter_group``) subgroups."""

    def __init__(self, dp_group: Optional[dist.ProcessGroup] = None, ranks_per_node: Optional[int] = None,
                 create_subgroups: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("megatron_ext needs torch.distributed to be initialised (init_process_group)")
        self.group = dp_group if dp_group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.global_ranks: List[int] = dist.get_process_group_ranks(self.group)
        if ranks_per_node is None:
            ranks_per_node = self._default_ranks_per_node()
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node <= 0:
            raise ValueError(f"ranks_per_node (--ranks-per-node) must be a positive integer, got {ranks_per_node!r}")
        if ranks_per_node > self.size:
            raise ValueError(
                f"ranks_per_node (--ranks-per-node)={ranks_per_node} is larger than the data-parallel group "
                f"({self.size} ranks): it counts the DP group's ranks per node, not processes per node; pass "
                f"group_members_per_node(group ranks, processes per node), or {self.size} for one node")
        if self.size % ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node (--ranks-per-node)={ranks_per_node} does not divide the data-parallel size "
                f"{self.size}: nodes must hold the same number of DP ranks")
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.size // ranks_per_node
        self.node = self.rank // ranks_per_node
        self.local_rank = self.rank % ranks_per_node
        self._intra_group: Optional[dist.ProcessGroup] = None
        self._inter_group: Optional[dist.ProcessGroup] = None
        if create_subgroups:
            self.create_subgroups()

    def _default_ranks_per_node(self) -> int:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if local_world <= 0:
            return self.size
        try:
            return group_members_per_node(self.global_ranks, local_world)
        except ValueError as e:
            if self.rank == 0:
                warn_once(f"{e}; treating the data-parallel group as one node (hierarchical backends use their "
                          "one-hop form and the ledger counts all traffic as intra-node): pass ranks_per_node "
                          "(--ranks-per-node) to choose")
            return self.size

    # -- subgroups -------------------------------------------------------------------------------------
    def create_subgroups(self, tag: str = "") -> None:
        """Create the node-local and cross-node subgroups (members only; same order on every rank)."""
        rpn, n = self.ranks_per_node, self.num_nodes
        if n == 1:
            self._intra_group, self._inter_group = self.group, None
        elif rpn == 1:
            self._intra_group, self._inter_group = None, self.group
        else:
            intra = [self.global_ranks[self.node * rpn + i] for i in range(rpn)]
            inter = [self.global_ranks[node * rpn + self.local_rank] for node in range(n)]
            self._intra_group = _subgroup(intra, tag)
            self._inter_group = _subgroup(inter, tag)

    def engine_clone(self, tag: str = "engine") -> "Topology":
        """This topology over fresh groups with the same ranks, for the progress engine's collectives.

        The engine issues from its own thread; the optimizer's scalar all-reduces stay on the original groups, so
        no group ever sees collectives from two threads (see [Note: progress engine] in progress.py). Members
        only, same order on every rank; cached like every subgroup. ``tag`` names the clone (``"speculative"``:
        the speculative step's weight gathers, optimizer/speculative_step.py).
        """
        clone = copy.copy(self)
        if self.size > 1:
            clone.group = _subgroup(self.global_ranks, tag)
        clone.create_subgroups(tag)
        return clone

    @property
    def intra_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks of this rank's node (None when a node holds a single rank)."""
        return self._intra_group

    @property
    def inter_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks with this rank's local index on every node (None on a single node)."""
        return self._inter_group

    # -- link classes ----------------------------------------------------------------------------------
    def same_node(self, group_rank: int) -> bool:
        return group_rank // self.ranks_per_node == self.node

    def peers(self) -> tuple[int, int]:
        """(intra-node peers, inter-node peers) of this rank in the DP group."""
        return self.ranks_per_node - 1, self.size - self.ranks_per_node

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]

    def subgroup(self, members: Sequence[int]) -> "Topology":
        """The topology of the group made of the DP ranks ``members`` (this rank among them), on the same nodes.

        Used for a sharding plan's optim and replica groups: contiguous blocks and strided sets of DP ranks, which
        sit evenly on nodes whenever the plan is aligned with nodes (checked by the plan). Only members call it.
        """
        members = sorted(members)
        if self.rank not in members:
            raise ValueError(f"DP rank {self.rank} is not in the subgroup {members}")
        if members == list(range(self.size)):
            return self
        per_node = group_members_per_node(members, self.ranks_per_node)
        return Topology(_subgroup([self.global_ranks[m] for m in members]), per_node)

    def __repr__(self) -> str:
        return (f"Topology(size={self.size}, rank={self.rank}, nodes={self.num_nodes}, "
                f"ranks_per_node={self.ranks_per_node})")


_SUBGROUPS: dict = {}


def _subgroup(ranks: List[int], tag: str = "") -> dist.ProcessGroup:
    """A process group over ``ranks`` created by its members only.

    With TP/PP, ranks of *other* DP groups never build this DP group's topology, so a world-wide ``new_group``
    (which every rank of the world must enter) would hang; ``use_local_synchronization`` needs only the members.
    Groups are cached per default group, rank list and ``tag`` (``"engine"``: the progress engine's clones), so
    building several wrappers does not leak groups.
    """
    key = (id(dist.group.WORLD), tuple(ranks), tag)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_group(ranks, use_local_synchronization=True, timeout=world_timeout())
    return _SUBGROUPS[key]


def world_timeout() -> Optional[datetime.timedelta]:
    """The default group's collective timeout (``init_process_group(timeout=...)``, pretrain_gpt's
    ``--distributed-timeout-minutes``), for the groups built here: ``new_group`` would otherwise give them torch's
    30-minute default, so a stalled peer would hold the others that long. None (torch's default) where the backend
    does not say."""
    try:
        world = dist.group.WORLD
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def group_members_per_node(global_ranks: Sequence[int], ranks_per_physical_node: int) -> int:
    """Members of a DP group (its global ranks, in group-rank order) on each node, nodes being contiguous blocks of
    ``ranks_per_physical_node`` global ranks (torchrun / Slurm). Raises ValueError when the group sits unevenly on
    nodes or its consecutive ranks interleave nodes (no hierarchical split describes that)."""
    if ranks_per_physical_node <= 0:
        raise ValueError(f"ranks per node must be positive, got {ranks_per_physical_node}")
    nodes = [g // ranks_per_physical_node for g in global_ranks]
    counts = {n: nodes.count(n) for n in nodes}
    per_node = set(counts.values())
    contiguous = all(nodes[i] <= nodes[i + 1] for i in range(len(nodes) - 1))
    if len(per_node) != 1 or not contiguous:
        raise ValueError(
            f"with {ranks_per_physical_node} ranks per node the data-parallel group {list(global_ranks)} sits on "
            f"nodes {nodes}: " + ("uneven ranks per node" if len(per_node) != 1 else "its ranks interleave nodes"))
    return per_node.pop()


_LOGGED: set = set()


def warn_once(msg: str) -> None:
    """Log a warning once per process (callers log from one rank of a group only, so: once per job)."""
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.warning(msg)
