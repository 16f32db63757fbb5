"""OverlapConfig: how the OverlappedDDP wrapper buckets, reduces and gathers (frozen, validated up front)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..comm.backend import BackendOptions
from ..comm.progress import engine_enabled_by_default
from .sharding import ShardingPlan

ACCUMULATE_POLICIES = ("auto", "shard", "local")
QGZ_DEFAULT_STAGES = 2
QGZ_AUTO_MIN_BUCKETS = 4
# Gradient bucket buffers (buffer alternation) when the config leaves it open: see buffer_pool_size_for.
BUFFER_POOL_SIZE = 2
BUFFER_POOL_SIZE_CPU = 3      # sums-only reductions (plain, ring) on CPU (gloo)


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """``sharding`` is the plan (optimizer/sharding.py). ``accumulate`` is another spelling of its gradient factor
    (``local``: grad = 1, ``shard``: grad = optim, ``auto``); it is folded into ``sharding`` and reset to None."""

    bucket_size: int = 40_000_000          # elements per bucket (--ddp-bucket-size); a larger param gets its own
    accumulate: Optional[str] = None       # --odo-accumulate: shard | local | auto (folded into sharding.grad)
    sharding: ShardingPlan = ShardingPlan()
    overlap_grad_reduce: bool = True       # async reduce-scatter per bucket as its grads are in (off: blocking)
    overlap_param_gather: bool = True      # all-gather after step, waited for by forward pre-hooks
    grad_reduce: str = "plain"             # --grad-reduce: plain | qgz | bytegrad
    param_gather: str = "plain"            # --param-gather: plain | qwz
    ranks_per_node: Optional[int] = None   # --ranks-per-node; default: LOCAL_WORLD_SIZE (one node if unset)
    # Live bucket buffers in the grad path (buffer alternation); None: auto (resolved_buffer_pool_size).
    buffer_pool_size: Optional[int] = None
    grad_reduce_in_fp32: bool = True       # bucket buffers in fp32 for bf16/fp16 params (megatron-core default)
    # --check-for-nan-in-loss-and-grad: a non-finite gradient norm raises on every rank before any weight changes
    check_for_nan_in_grad: bool = False
    quant_group_size: int = 2048           # --quant-group-size
    qgz_bits: int = 4                      # --qgz-bits
    # qgZ stages per bucket (pipelined intra/inter-node hops inside one bucket). None: auto -- 1 when the progress
    # engine runs and there are at least QGZ_AUTO_MIN_BUCKETS buckets (consecutive buckets already keep both link
    # classes busy, and each stage costs a pair of all-to-alls and a pass of the kernels per bucket), else 2.
    # The default stays 2 (the wire layout the ledger's closed forms and checked volumes assume); bench_cluster
    # and --qgz-pipeline-stages auto use None.
    qgz_pipeline_stages: Optional[int] = QGZ_DEFAULT_STAGES
    shard_alignment: int = 64              # elements; at least 128 bytes for 2-byte dtypes
    gather_pool_size: int = 4              # ZeRO-3: full-weight bucket buffers alive at once (prefetch bound)
    # --odo-progress-engine: a progress engine runs every gradient reduction (comm/progress.py: a thread; inline on
    # CUDA + NCCL); off: the synchronous path (hops advanced on the training thread). Default:
    # MEGATRON_EXT_PROGRESS_ENGINE.
    progress_engine: bool = dataclasses.field(default_factory=engine_enabled_by_default)
    # --odo-speculative-step: each bucket's update and weight gather start in backward, as soon as its gradient is
    # reduced, assuming the global clipping will not scale it; undone and redone exactly when it does
    # (optimizer/speculative_step.py). ZeRO-1/2, CPU (gloo), without fp16 loss scaling.
    speculative_step: bool = False

    def __post_init__(self) -> None:
        for name in ("overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32", "check_for_nan_in_grad",
                     "progress_engine", "speculative_step"):
            if not isinstance(getattr(self, name), bool):   # a "False" string from a file would switch it on
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("gather_pool_size", "shard_alignment", "quant_group_size", "qgz_bits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an integer, got {v!r}")
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size <= 0:
            raise ValueError(f"bucket_size (--ddp-bucket-size) must be a positive integer, got {self.bucket_size!r}")
        if not isinstance(self.sharding, ShardingPlan):
            raise TypeError(f"sharding must be a megatron_ext.ShardingPlan, got {type(self.sharding).__name__}")
        if self.accumulate is not None:
            object.__setattr__(self, "sharding", fold_accumulate(self.sharding, self.accumulate))
            object.__setattr__(self, "accumulate", None)
        if self.gather_pool_size < 1:
            raise ValueError(f"gather_pool_size must be >= 1, got {self.gather_pool_size}")
        if self.buffer_pool_size is not None and (not isinstance(self.buffer_pool_size, int)
                                                  or self.buffer_pool_size < 1):
            raise ValueError(f"buffer_pool_size must be None (auto) or an integer >= 1, got {self.buffer_pool_size!r}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError("ranks_per_node (--ranks-per-node) must be a positive integer, "
                             f"got {self.ranks_per_node!r}")
        if self.shard_alignment < 1:
            raise ValueError(f"shard_alignment must be >= 1, got {self.shard_alignment}")
        self.backend_options()  # validates the quantizer knobs

    def backend_options(self) -> BackendOptions:
        stages = self.qgz_pipeline_stages if self.qgz_pipeline_stages is not None else QGZ_DEFAULT_STAGES
        return BackendOptions(quant_group_size=self.quant_group_size, qgz_bits=self.qgz_bits,
                              qgz_pipeline_stages=stages)

    def resolved_buffer_pool_size(self, device: torch.device, sums_only: bool) -> int:
        """The gradient bucket buffers of a wrapper whose buckets live on ``device`` and whose reduction of a bucket
        is ``sums_only`` (see :func:`buffer_pool_size_for`)."""
        return buffer_pool_size_for(self.buffer_pool_size, device.type, sums_only)

    def resolved_qgz_stages(self, buckets: int, engine: bool) -> int:
        """The qgZ stage count for a wrapper with ``buckets`` buckets (see ``qgz_pipeline_stages``)."""
        if self.qgz_pipeline_stages is not None:
            return self.qgz_pipeline_stages
        return 1 if engine and buckets >= QGZ_AUTO_MIN_BUCKETS else QGZ_DEFAULT_STAGES


def buffer_pool_size_for(explicit: Optional[int], device_type: str, sums_only: bool) -> int:
    """Gradient bucket buffers: ``explicit`` when set, else the default. Two where the collectives of one group run
    one after the other (NCCL's stream): the older of two in-flight reductions finishes, and frees its buffer, while
    the link still carries the newer one, so the next bucket fills behind it. Three on CPU when a bucket's reduction
    is one collective (``plain`` in a single stage; the device stands for gloo, the CPU backend): gloo's process
    group runs two collectives at once (two worker threads), two in-flight reduce-scatters share the link and finish
    together, and with two buffers the link then idles while backward fills the next bucket (traced at 200 Mbit/s
    with 20 buckets: 1.45 s of backward for 1.19 s of link time; a third buffer: plain 2.24 -> 2.12 s per step, qwZ
    1.80 -> 1.68 s). The ring (``P - 1`` hops with only an add between them) too: with two buffers the link was busy
    79% of the backward at 200 Mbit/s, waiting for buckets that the pool held back; with three, 84%, and the step
    fell 3% (ring and qwZ + ring, 3 of 3 alternating pairs each; docs/benchmarks). Quantized and staged reductions
    keep two: their kernels compete with backward for the cores, and a third work in flight cost qwZ + qgZ INT4 15%
    at 200 Mbit/s (0.65 -> 0.75 s). ``sums_only``: :func:`~megatron_ext.optimizer.plan_comm.sums_only_reduction`."""
    if explicit is not None:
        return explicit
    return BUFFER_POOL_SIZE_CPU if device_type == "cpu" and sums_only else BUFFER_POOL_SIZE


def fold_accumulate(plan: ShardingPlan, accumulate: str) -> ShardingPlan:
    """The plan with ``--odo-accumulate`` applied to its gradient factor; a contradiction is an error."""
    if accumulate not in ACCUMULATE_POLICIES:
        raise ValueError(f"accumulate (--odo-accumulate) must be one of {ACCUMULATE_POLICIES}, got {accumulate!r}")
    if accumulate == "auto":    # the default: the plan's own gradient factor stands
        return plan
    if accumulate == "local" and plan.param != 1:
        raise ValueError("--odo-accumulate local keeps full gradients between micro-batches, which parameter "
                         "sharding (--param-shard-size > 1) does not have: use shard or auto")
    grad = {"local": plan.param, "shard": plan.optim}[accumulate]
    if plan.grad == "auto" or plan.grad == grad:
        return dataclasses.replace(plan, grad=grad)
    raise ValueError(f"--odo-accumulate {accumulate} means grad (--grad-shard-size) = {grad or 'the DP size'}, but "
                     f"the sharding plan sets grad={plan.grad}: give one of the two")
