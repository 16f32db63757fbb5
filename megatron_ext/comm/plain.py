"""The ``plain`` backend: torch.distributed reduce-scatter and all-gather over the whole DP group."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .backend import CompletedWork, GradReduce, ParamGather, TorchWork, Work, register_grad_reduce, \
    register_param_gather
from .ledger import CommLedger
from .topology import Topology


@register_grad_reduce("plain")
class PlainGradReduce(GradReduce):
    def reduce_scatter(self, bucket: torch.Tensor, out_shard: torch.Tensor) -> Work:
        done = self._local_reduce_scatter(bucket, out_shard)
        if done is not None:
            return done
        topo = self.topology
        n = out_shard.numel()
        intra, inter = topo.peers()
        self.ledger.record_pairwise("reduce_scatter", n * bucket.element_size(), intra, inter)
        if out_shard.dtype == bucket.dtype:
            target = out_shard
        else:
            target = torch.empty(n, dtype=bucket.dtype, device=bucket.device)
        handle = _reduce_scatter(target, bucket, group=topo.group)
        inv = 1.0 / topo.size

        def epilogue() -> None:
            if target is out_shard:
                out_shard.mul_(inv)
            else:
                out_shard.copy_(target).mul_(inv)

        return TorchWork(handle, epilogue)

    @property
    def all_reduce_alignment(self) -> int:
        return 1

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """Average over the group with one all-reduce (ledger: 2B/P to each peer, as for the scalar all-reduces)."""
        topo = self.topology
        if topo.size == 1:
            return CompletedWork()
        intra, inter = topo.peers()
        self.ledger.record_pairwise("all_reduce", -(-2 * tensor.numel() * tensor.element_size() // topo.size),
                                    intra, inter)
        handle = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
        inv = 1.0 / topo.size
        return TorchWork(handle, lambda: tensor.mul_(inv))


@register_param_gather("plain")
class PlainParamGather(ParamGather):
    def all_gather(self, shard: torch.Tensor, out_bucket: torch.Tensor) -> Work:
        return all_gather_recorded(self.topology, self.ledger, shard, out_bucket, "all_gather")


def local_gather(topo: Topology, shard: torch.Tensor, out: torch.Tensor) -> Optional[Work]:
    """Checks an all-gather's sizes; the finished work when nothing needs sending (one rank, empty shard)."""
    n = shard.numel()
    if out.numel() != n * topo.size:
        raise ValueError(f"bucket of {out.numel()} elements does not split into {topo.size} shards of {n}")
    if topo.size == 1:
        if shard.data_ptr() != out.data_ptr():
            out.copy_(shard)
        return CompletedWork()
    return CompletedWork() if n == 0 else None


def all_gather_recorded(topo: Topology, ledger: CommLedger, shard: torch.Tensor, out: torch.Tensor,
                        name: str) -> Work:
    """Async all-gather of equal shards into ``out`` (``shard`` may alias its own slice), recorded as ``name``."""
    done = local_gather(topo, shard, out)
    if done is not None:
        return done
    n = shard.numel()
    intra, inter = topo.peers()
    ledger.record_pairwise(name, n * shard.element_size(), intra, inter)
    return TorchWork(_all_gather(out, shard, group=topo.group))


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group):
    """Async sum reduce-scatter; torch >= 2.13 renames reduce_scatter_tensor to reduce_scatter_single."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=True)
