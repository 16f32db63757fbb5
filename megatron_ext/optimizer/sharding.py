"""ShardingPlan: how many DP ranks share each component of the model states (AMSP, seed 004 section IV-B).

[Note: the plan]
Each factor is the number of data-parallel ranks in that component's *shard group*; a component is sharded inside
its group and replicated across the groups. Groups are contiguous blocks of DP ranks, so with nodes being
contiguous blocks of ``R`` ranks a factor ``<= R`` is node-local.

- ``param``: ranks a parameter is sharded over (1: every rank holds full weights; > 1: ZeRO-3, the weights exist
  in full only while a module needs them, see optimizer/param_schedule.py). Implemented with
  ``grad = optim = param`` (ZeRO-3 over the whole DP group, or over a node and replicated across nodes).
- ``optim``: ranks the optimizer states (and fp32 masters) of a bucket are split over. Rank ``r`` updates shard
  ``r % optim`` of every bucket; the updated weights are all-gathered inside the optim group only.
- ``grad``: ranks the *accumulated* gradient is split over between micro-batches. Seed 004 restricts it to
  ``{param, optim}`` (eq. ``s_g in {s_p, s_os}``): ``grad == optim`` reduce-scatters every micro-batch into the
  optimizer shard (ZeRO-2 memory, the ``shard`` accumulation policy); ``grad == 1`` keeps full gradients between
  micro-batches and reduces once per step (the ``local`` policy, M times less traffic). ``"auto"`` picks per step:
  ``1`` when the step has more than one micro-batch, ``optim`` otherwise.
- ``hpz``: secondary weight partition size (ZeRO++ hpZ, DeepSpeed's ``zero_hpz_partition_size``; needs
  ``param > 1``): after forward each rank keeps a 1/hpz piece of every bucket inside a node-local group of ``hpz``
  ranks, and the backward re-gathers from those pieces without crossing nodes.

``None`` means the whole DP group. ``ShardingPlan()`` is today's behaviour: ZeRO-2 over the whole DP group with
automatic accumulation.

[Note: executing a plan]
At the micro-batch that completes a step's gradients, each bucket is reduce-scattered inside the optim group
(``optim`` ranks: rank ``r`` receives shard ``r % optim`` averaged over its group), then all-reduced across the
``DP / optim`` replicas of that group (ranks with the same shard index: ``r % optim`` equal). The cross-node part
therefore moves ``1/optim`` of the bucket per rank, on every rank of a node in parallel. AMSP's all-reduce followed
by *select & drop* computes the same values with more traffic; ours is its reduce-scatter equivalent (possible
because our shards are equal intra-tensor slices, see seed 004 Fig. 6a).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Union

GradFactor = Union[int, None, str]

_FLAGS = {"param": "--param-shard-size", "grad": "--grad-shard-size", "optim": "--optim-shard-size",
          "hpz": "--hpz-partition-size"}


def _flag(name: str) -> str:
    return f"{name} ({_FLAGS[name]})"


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    param: int = 1
    grad: GradFactor = "auto"
    optim: Optional[int] = None
    hpz: int = 1

    def __post_init__(self) -> None:
        for name in ("param", "hpz"):
            v = getattr(self, name)
            if name == "param" and v == -1:
                continue   # zero3() over the whole DP group
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{_flag(name)} must be a positive integer, got {v!r}")
        if self.optim is not None and (isinstance(self.optim, bool) or not isinstance(self.optim, int)
                                       or self.optim < 1):
            raise ValueError(f"{_flag('optim')} must be a positive integer or None (the whole DP group), "
                             f"got {self.optim!r}")
        if not (self.grad is None or self.grad == "auto"
                or (isinstance(self.grad, int) and not isinstance(self.grad, bool) and self.grad >= 1)):
            raise ValueError(f"{_flag('grad')} must be a positive integer, None (the whole DP group) or 'auto', "
                             f"got {self.grad!r}")
        if self.hpz > 1 and self.param == 1:
            raise ValueError(f"{_flag('hpz')}={self.hpz} needs parameter sharding ({_flag('param')} > 1): hpZ "
                             "keeps secondary pieces of sharded weights")

    # -- presets ----------------------------------------------------------------------------------------------
    @classmethod
    def zero1(cls, optim: Optional[int] = None) -> "ShardingPlan":
        """Optimizer states sharded, full gradients accumulated locally and reduced once per step."""
        return cls(grad=1, optim=optim)

    @classmethod
    def zero2(cls, optim: Optional[int] = None) -> "ShardingPlan":
        """Optimizer states and gradients sharded; every micro-batch is reduce-scattered."""
        return cls(grad=optim, optim=optim)

    @classmethod
    def mics(cls, shard_size: int) -> "ShardingPlan":
        """MiCS / HSDP-like: gradients and optimizer states sharded over ``shard_size`` ranks (a node), replicated
        across those groups; megatron-core's ``--num-distributed-optimizer-instances DP/shard_size``."""
        return cls(grad=shard_size, optim=shard_size)

    hsdp = mics

    @classmethod
    def amsp_7b(cls, shard_size: int) -> "ShardingPlan":
        """AMSP's LLaMA-7B plan (s_p = s_g = 1, s_os = GPUs per node): full parameters and gradients on every
        rank, optimizer states sharded inside a node; parameters are gathered inside the node only."""
        return cls(grad=1, optim=shard_size)

    @classmethod
    def zero3(cls, shard_size: Optional[int] = None, hpz: int = 1) -> "ShardingPlan":
        """ZeRO-3: parameters, gradients and optimizer states sharded over ``shard_size`` ranks (None: the whole DP
        group); ``hpz > 1`` adds ZeRO++'s secondary partitions inside a node. ``param=None`` is resolved with the
        DP size."""
        return cls(param=shard_size if shard_size is not None else -1, grad=shard_size, optim=shard_size, hpz=hpz)

    @classmethod
    def from_instances(cls, instances: int, dp_size: int) -> "ShardingPlan":
        """megatron-core's ``--num-distributed-optimizer-instances K``: ``grad = optim = DP / K``."""
        if instances < 1 or dp_size % instances:
            raise ValueError(f"--num-distributed-optimizer-instances={instances} must divide the data-parallel "
                             f"size {dp_size}")
        return cls.mics(dp_size // instances)

    def describe(self) -> str:
        def f(v) -> str:
            return "dp" if v is None or v == -1 else str(v)
        return f"param={f(self.param)} grad={f(self.grad)} optim={f(self.optim)}" + (
            f" hpz={self.hpz}" if self.hpz > 1 else "")

    def resolve(self, dp_size: int, ranks_per_node: int, dp_rank: int) -> "ResolvedPlan":
        """Check seed 004's rules for this DP group (no collective) and compute this rank's groups."""
        if ranks_per_node < 1 or dp_size % ranks_per_node:
            raise ValueError(f"ranks per node ({ranks_per_node}) must divide the data-parallel size {dp_size}")
        optim = dp_size if self.optim is None else self.optim
        param = dp_size if self.param == -1 else self.param
        grad = self.grad
        if grad is None:
            grad = dp_size
        if param > 1 and grad == "auto":
            grad = optim   # sharded weights leave no full gradient to accumulate locally
        factors = {"param": param, "optim": optim}
        if grad != "auto":
            factors["grad"] = grad
        for name, v in factors.items():
            if dp_size % v:
                raise ValueError(f"{_flag(name)}={v} does not divide the data-parallel size {dp_size} "
                                 "(seed 004 eq. 5-6: every rank must hold one shard)")
            if ranks_per_node % v and v % ranks_per_node:
                raise ValueError(
                    f"{_flag(name)}={v} is not aligned with nodes of {ranks_per_node} DP ranks (--ranks-per-node): "
                    f"a shard group must fit inside a node (divide {ranks_per_node}) or span whole nodes (a "
                    f"multiple of {ranks_per_node}) (seed 004 section IV-B, device mesh)")
        if optim % param:
            raise ValueError(f"{_flag('param')}={param} must divide {_flag('optim')}={optim} "
                             "(seed 004 dependency rule: param <= grad <= optim)")
        if grad != "auto":
            if not param <= grad <= optim:
                raise ValueError(f"{_flag('grad')}={grad} must lie between {_flag('param')}={param} and "
                                 f"{_flag('optim')}={optim} (seed 004 dependency rule: param <= grad <= optim)")
            if grad not in (param, optim):
                raise ValueError(f"{_flag('grad')}={grad} must equal {_flag('param')}={param} (accumulate full "
                                 f"gradients, --odo-accumulate local) or {_flag('optim')}={optim} (reduce every "
                                 "micro-batch, --odo-accumulate shard): seed 004 section IV-C.3, s_g in {s_p, s_os}")
        if param > 1 and not param == grad == optim:
            raise ValueError(f"{_flag('param')}={param} needs {_flag('grad')} and {_flag('optim')} equal to it "
                             f"(got grad={grad}, optim={optim}): ZeRO-3 with other gradient or optimizer-state "
                             "factors is not implemented")
        if self.hpz > 1:
            if param % self.hpz or ranks_per_node % self.hpz:
                raise ValueError(f"{_flag('hpz')}={self.hpz} must divide {_flag('param')}={param} and the "
                                 f"{ranks_per_node} DP ranks per node (--ranks-per-node): the secondary pieces live "
                                 "inside a node, within the param group (seed 000 section 3.2)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"DP rank {dp_rank} outside a group of {dp_size}")
        block = dp_rank - dp_rank % optim
        hpz_block = dp_rank - dp_rank % self.hpz
        return ResolvedPlan(plan=self, dp_size=dp_size, ranks_per_node=ranks_per_node, dp_rank=dp_rank,
                            optim=optim, grad=grad, param=param, hpz=self.hpz,
                            hpz_members=list(range(hpz_block, hpz_block + self.hpz)),
                            optim_members=list(range(block, block + optim)),
                            replica_members=list(range(dp_rank % optim, dp_size, optim)))


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """A plan checked against one DP group: integer factors and this rank's groups (DP ranks)."""

    plan: ShardingPlan
    dp_size: int
    ranks_per_node: int
    dp_rank: int
    optim: int
    grad: Union[int, str]          # an int, or "auto" (decided per step)
    param: int
    hpz: int
    hpz_members: List[int]         # this rank's hpZ secondary group (contiguous block, node-local)
    optim_members: List[int]       # this rank's optim shard group (contiguous block)
    replica_members: List[int]     # the ranks holding the same optimizer shard (one per optim group)

    @property
    def replicas(self) -> int:
        return self.dp_size // self.optim

    @property
    def shard_rank(self) -> int:
        """Index of this rank's shard in every bucket (its rank inside the optim group)."""
        return self.dp_rank % self.optim

    @property
    def replica_rank(self) -> int:
        return self.dp_rank // self.optim

    def accumulates_locally(self, multiple_micro_batches: bool) -> bool:
        """True when the step keeps full gradients between micro-batches (grad = 1 < optim, or auto with M > 1)."""
        if self.grad == "auto":
            return multiple_micro_batches and self.optim > 1 and self.param == 1
        return self.grad < self.optim

    def grad_factor(self, multiple_micro_batches: bool) -> int:
        return 1 if self.accumulates_locally(multiple_micro_batches) else self.optim

    @property
    def hpz_rank(self) -> int:
        return self.dp_rank % self.hpz

    def short(self) -> str:
        """A few characters for the training log line, e.g. ``g1/o8x4`` (grad 1, optim 8, 4 replicas)."""
        g = "a" if self.grad == "auto" else str(self.grad)
        p = f"p{self.param}/" if self.param > 1 else ""
        h = f"/h{self.hpz}" if self.hpz > 1 else ""
        return f"{p}g{g}/o{self.optim}x{self.replicas}{h}"

    def describe(self) -> str:
        g = self.grad if self.grad != "auto" else f"auto(1|{self.optim})"
        h = f" hpz={self.hpz}" if self.hpz > 1 else ""
        return (f"param={self.param} grad={g} optim={self.optim}{h} (x{self.replicas} replicas), "
                f"DP={self.dp_size}, {self.ranks_per_node} DP ranks per node")
