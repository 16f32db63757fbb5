"""megatron-ext: communication-efficient training for megatron-core / Megatron-LM.

Public API::

    import megatron_ext as mx
    model = mx.OverlappedDDP(module, mx.OverlapConfig(...), dp_group=None)
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(...), model)
"""
from __future__ import annotations

from .optimizer.config import OverlapConfig
from .optimizer.sharding import ShardingPlan

__version__ = "0.1.0"

__all__ = ["OverlapConfig", "ShardingPlan", "OverlappedDDP", "OverlappedDistributedOptimizer", "CommLedger"]


def __getattr__(name: str):
    # Lazy so that `import megatron_ext.kernels` does not pull in the optimizer (or megatron-core).
    if name == "OverlappedDDP":
        from .optimizer.overlapped_ddp import OverlappedDDP
        return OverlappedDDP
    if name == "OverlappedDistributedOptimizer":
        from .optimizer.distributed_optimizer import OverlappedDistributedOptimizer
        return OverlappedDistributedOptimizer
    if name == "CommLedger":
        from .comm.ledger import CommLedger
        return CommLedger
    raise AttributeError(f"module 'megatron_ext' has no attribute {name!r}")
