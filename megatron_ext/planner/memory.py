"""Memory per GPU of a candidate: the ODO's exact buckets and model-state formula, plus activations.

The buckets are built by the ODO's own ``assign_buckets`` on meta tensors (no memory), with the alignment the
plan's backends ask for (``plan_alignment`` mirrors ``PlanComm.shard_alignment``; a test checks the two agree),
so the model-state bytes equal ``model.memory_report()`` for every plan that runs. Activations follow
``ModelSpec.activation_bytes`` (Megatron's formula); ZeRO-3 adds its gather pool (full-weight buffers of the
buckets gathered at once), reported as transient memory like activations.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..optimizer.bucketing import assign_buckets
from ..optimizer.config import BUFFER_POOL_SIZE, buffer_pool_size_for
from ..optimizer.memory import model_state_bytes
from ..optimizer.plan_comm import stage_backend_names, sums_only_reduction
from ..optimizer.sharding import ResolvedPlan
from .candidate import Candidate
from .volumes import BucketShape, plan_groups

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """What the ODO's memory depends on besides the plan: dtypes, optimizer, pools."""

    params_dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True
    optimizer: str = "adam"
    # None: the wrapper's own depth on ``device`` (optimizer/config.py buffer_pool_size_for: 3 for a
    # sums-only reduction on CPU, else 2). The cost model's time replay issues plain's collectives one after the
    # other, which is what the CPU's third buffer restores on gloo, so for plain it replays 2 unless this is set;
    # the ring's third buffer lets backward run ahead of its hops, which the replay does model (3).
    buffer_pool_size: Optional[int] = None
    device: str = "cuda"                 # "cpu": the ODO on gloo
    gather_pool_size: int = 4
    shard_alignment: int = 64
    quant_group_size: int = 2048
    qgz_pipeline_stages: int = 2

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def grad_bytes(self) -> int:
        return 4 if self.grad_reduce_in_fp32 else self.param_bytes

    def pool_buffers(self, plan: ResolvedPlan, grad_reduce: str) -> int:
        """The gradient bucket buffers the wrapper keeps under this plan and backend."""
        return buffer_pool_size_for(self.buffer_pool_size, self.device, sums_only_reduction(plan, grad_reduce))

    def replayed_pool_buffers(self, plan: ResolvedPlan, grad_reduce: str) -> int:
        """The buffers the time model replays (see ``buffer_pool_size``)."""
        if self.buffer_pool_size is not None:
            return self.buffer_pool_size
        ring = stage_backend_names(plan, grad_reduce)[0] == "ring"
        return self.pool_buffers(plan, grad_reduce) if ring else BUFFER_POOL_SIZE

    @property
    def state_bytes(self) -> int:
        return {"adam": 8, "adamw": 8, "sgd": 4}[self.optimizer]


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def plan_alignment(cand: Candidate, plan: ResolvedPlan, setup: TrainingSetup) -> int:
    """Elements every bucket shard is a multiple of (``OverlappedDDP``: lcm of 64 and ``PlanComm.shard_alignment``)."""
    optim, replicas = plan_groups(plan)
    optim_backend, replica_backend = stage_backend_names(plan, cand.grad_reduce)

    def shard_align(name: str) -> int:
        return 2 * setup.qgz_pipeline_stages if name == "qgz" else 1

    align = _lcm(setup.shard_alignment, shard_align(optim_backend))
    if replicas is not None:
        name = replica_backend
        if name == "bytegrad":
            align = _lcm(align, replicas.nodes if replicas.nodes > 1 else replicas.size)
        elif name == "qgz":
            align = _lcm(align, replicas.size * shard_align("qgz"))
        elif name == "ring":   # GradReduce.all_reduce's default: a piece per replica
            align = _lcm(align, replicas.size)
    if plan.hpz > 1:
        align = _lcm(align, plan.hpz)
    return align


def bucket_shapes(param_numels: Sequence[int], cand: Candidate, plan: ResolvedPlan,
                  setup: TrainingSetup) -> Tuple[List[BucketShape], List[int]]:
    """The ODO's buckets for these parameters (registration order) under this candidate, and their data numels."""
    dtype = torch.bfloat16 if setup.param_bytes == 2 else torch.float32
    params = [torch.empty(n, dtype=dtype, device="meta") for n in param_numels]
    buckets = assign_buckets(params, cand.bucket_size, plan.optim, plan_alignment(cand, plan, setup))
    return [BucketShape(b.numel, b.shard_numel) for b in buckets], [b.data_numel for b in buckets]


def owned_numel(buckets: Sequence[BucketShape], data_numels: Sequence[int], shard_rank: int) -> int:
    """Real parameter elements in shard ``shard_rank`` of every bucket (what the optimizer keeps states for)."""
    return sum(max(0, min(b.shard_numel, d - shard_rank * b.shard_numel)) for b, d in zip(buckets, data_numels))


def model_state_memory(cand: Candidate, plan: ResolvedPlan, buckets: Sequence[BucketShape],
                       data_numels: Sequence[int], setup: TrainingSetup, micro_batches: int,
                       deferred_numel: int = 0) -> Dict[str, int]:
    """Model-state bytes of DP rank ``plan.dp_rank``, per component (``optimizer.memory.model_state_bytes``).

    ``deferred_numel``: elements reduced over a model-parallel group first; their buckets keep buffers of their own
    in every accumulation mode (the bucket layout is taken as without them: a few elements of padding apart)."""
    padded = sum(b.numel for b in buckets)
    local = plan.accumulates_locally(micro_batches > 1)
    lossless_fp32 = setup.param_bytes == 4 and cand.param_gather == "plain"
    largest = max(b.numel for b in buckets)
    pool = setup.pool_buffers(plan, cand.grad_reduce) if not plan.accumulates_locally(micro_batches > 1) else 0
    return model_state_bytes(
        padded_numel=padded, owned_numel=owned_numel(buckets, data_numels, plan.shard_rank),
        param_bytes=setup.param_bytes, grad_bytes=setup.grad_bytes, param_shards=plan.param,
        optim_shards=plan.optim, full_grad_buffer=local, master_bytes=0 if lossless_fp32 else 4,
        state_bytes=setup.state_bytes,
        pool_bytes=pool * setup.grad_bytes * largest, hpz=plan.hpz, deferred_numel=deferred_numel)


def transient_memory(plan: ResolvedPlan, buckets: Sequence[BucketShape], setup: TrainingSetup) -> int:
    """ZeRO-3's gather pool: at most ``gather_pool_size`` full buckets gathered at once."""
    if plan.param == 1:
        return 0
    largest = max(b.numel for b in buckets)
    return min(setup.gather_pool_size, len(buckets)) * largest * setup.param_bytes
