"""OverlapConfig: how the OverlappedDDP wrapper buckets, reduces and gathers (frozen, validated up front)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..comm.backend import BackendOptions

ACCUMULATE_POLICIES = ("auto", "shard", "local")


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    bucket_size: int = 40_000_000          # elements per bucket (--ddp-bucket-size); a larger param gets its own
    accumulate: str = "auto"               # --odo-accumulate: shard | local | auto
    overlap_grad_reduce: bool = True       # async reduce-scatter per bucket as its grads are in (off: blocking)
    overlap_param_gather: bool = True      # all-gather after step, waited for by forward pre-hooks
    grad_reduce: str = "plain"             # --grad-reduce: plain | qgz | bytegrad
    param_gather: str = "plain"            # --param-gather: plain | qwz
    ranks_per_node: Optional[int] = None   # --ranks-per-node; default: LOCAL_WORLD_SIZE (one node if unset)
    buffer_pool_size: int = 2              # live bucket buffers in the grad path (buffer alternation)
    grad_reduce_in_fp32: bool = True       # bucket buffers in fp32 for bf16/fp16 params (megatron-core default)
    quant_group_size: int = 2048           # --quant-group-size
    qgz_bits: int = 4                      # --qgz-bits
    qgz_pipeline_stages: int = 2
    shard_alignment: int = 64              # elements; at least 128 bytes for 2-byte dtypes

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_size, int) or self.bucket_size <= 0:
            raise ValueError(f"bucket_size (--ddp-bucket-size) must be a positive integer, got {self.bucket_size!r}")
        if self.accumulate not in ACCUMULATE_POLICIES:
            raise ValueError(f"accumulate (--odo-accumulate) must be one of {ACCUMULATE_POLICIES}, "
                             f"got {self.accumulate!r}")
        if self.buffer_pool_size < 1:
            raise ValueError(f"buffer_pool_size must be >= 1, got {self.buffer_pool_size}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError("ranks_per_node (--ranks-per-node) must be a positive integer, "
                             f"got {self.ranks_per_node!r}")
        if self.shard_alignment < 1:
            raise ValueError(f"shard_alignment must be >= 1, got {self.shard_alignment}")
        self.backend_options()  # validates the quantizer knobs

    def backend_options(self) -> BackendOptions:
        return BackendOptions(quant_group_size=self.quant_group_size, qgz_bits=self.qgz_bits,
                              qgz_pipeline_stages=self.qgz_pipeline_stages)
