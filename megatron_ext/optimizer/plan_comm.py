"""The groups and backends that execute a resolved sharding plan (see [Note: executing a plan] in sharding.py).

[Note: which stage a backend quantizes]
A bucket's gradients are reduce-scattered inside the optim group, then all-reduced across its replicas; weights
are all-gathered inside the optim group. ``qgz`` and ``bytegrad`` quantize the *cross-node* part of the reduction:
a stage whose group spans several nodes runs the configured backend (qgZ: its hierarchical form over that group's
nodes; across replicas: a quantized reduce-scatter then a quantized all-gather, every rank decoding alike), a
node-local stage runs ``plain``. When no stage crosses nodes (one node) the configured backend runs every stage in
its one-hop form, as without a plan. ``qwz`` quantizes the parameter gather, node-local or not: it was asked for.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from ..comm.backend import GradReduce, ParamGather, build_grad_reduce, build_param_gather
from ..comm.engine_backend import EngineGradReduce
from ..comm.progress import ProgressEngine
from ..comm.ledger import CommLedger
from ..comm.topology import Topology
from .sharding import ResolvedPlan


@dataclasses.dataclass
class PlanComm:
    plan: ResolvedPlan
    optim: Topology                      # the optim shard group: reduce-scatter and parameter all-gather
    replicas: Optional[Topology]         # ranks holding the same shard (None: one replica)
    grad_reduce: GradReduce
    replica_reduce: Optional[GradReduce]
    param_gather: ParamGather
    hpz: Optional[Topology] = None       # hpZ secondary group (node-local), when the plan has one

    def set_qgz_stages(self, stages: int) -> None:
        """Use ``stages`` qgZ pipeline stages from now on (the alignment of 2 * the default stays valid)."""
        for be in (self.grad_reduce, self.replica_reduce):
            if be is None:
                continue
            be = getattr(be, "inner", be)
            be.options = dataclasses.replace(be.options, qgz_pipeline_stages=stages)

    @property
    def shard_alignment(self) -> int:
        """Elements a bucket shard must be a multiple of for every stage of this plan."""
        align = _lcm(self.grad_reduce.shard_alignment, self.param_gather.shard_alignment)
        if self.replica_reduce is not None:
            align = _lcm(align, self.replica_reduce.all_reduce_alignment)
        if self.hpz is not None:   # the bucket (optim shards) cuts into hpz equal secondary pieces
            align = _lcm(align, self.hpz.size)
        return align


def stage_group_shapes(plan: ResolvedPlan) -> Tuple[Tuple[int, int], Optional[Tuple[int, int]]]:
    """``(size, ranks per node)`` of the optim group and of the replica group (None: one replica); a pure function
    of the plan, so the planner computes the same groups without a process group."""
    rpn = plan.ranks_per_node
    optim = (plan.optim, min(plan.optim, rpn))
    replicas = (plan.replicas, max(1, min(plan.replicas, rpn // plan.optim))) if plan.replicas > 1 else None
    return optim, replicas


def stage_backend_names(plan: ResolvedPlan, grad_reduce: str) -> Tuple[str, Optional[str]]:
    """The gradient backend of the optim stage and of the replica stage ([Note: which stage a backend quantizes])."""
    shapes = [s for s in stage_group_shapes(plan) if s is not None]
    crossing = any(size > per_node for size, per_node in shapes)

    def name(shape) -> str:
        size, per_node = shape
        return grad_reduce if (size > per_node or not crossing) else "plain"

    optim, replicas = stage_group_shapes(plan)
    return name(optim), (name(replicas) if replicas is not None else None)


def sums_only_reduction(plan: ResolvedPlan, grad_reduce: str) -> bool:
    """Whether a bucket's gradient reduction under this plan is one stage that only sums between its messages:
    ``plain`` (one collective) or ``ring`` (``P - 1`` hops with an add between them), no quantization kernels."""
    optim, replica = stage_backend_names(plan, grad_reduce)
    return optim in ("plain", "ring") and replica is None


def build_plan_comm(plan: ResolvedPlan, dp: Topology, grad_reduce: str, param_gather: str, ledger: CommLedger,
                    options, engine: Optional[ProgressEngine] = None) -> PlanComm:
    """Create this rank's plan groups (members only, same order on every rank) and the stage backends.

    With a progress ``engine`` the gradient backends run on the engine thread over clones of the stage groups (see
    [Note: progress engine] in comm/progress.py); the clones are created right after the originals. The weight
    gather stays on the training thread, on the original optim group: it is one hop, issued after the step and
    waited for in forward, so the engine has nothing to advance, and handing each bucket's wait to it cost more
    than it saved (see the note).
    """
    optim = dp.subgroup(plan.optim_members)
    replicas = dp.subgroup(plan.replica_members) if plan.replicas > 1 else None
    stages = [t for t in (optim, replicas) if t is not None]
    hpz = dp.subgroup(plan.hpz_members) if plan.hpz > 1 else None
    clones = {id(t): (t.engine_clone() if engine is not None else t) for t in stages}
    optim_name, replica_name = stage_backend_names(plan, grad_reduce)

    def grad_backend(t: Topology, name: str) -> GradReduce:
        inner = build_grad_reduce(name, clones[id(t)], ledger, options)
        return EngineGradReduce(inner, engine) if engine is not None else inner

    gather = build_param_gather(param_gather, optim, ledger, options)
    return PlanComm(plan=plan, optim=optim, replicas=replicas, grad_reduce=grad_backend(optim, optim_name),
                    replica_reduce=grad_backend(replicas, replica_name) if replicas is not None else None,
                    param_gather=gather, hpz=hpz)


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out
