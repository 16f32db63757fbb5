"""Hierarchical subgroups are built by the members of one DP group only (other DP groups never join)."""
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx


def _two_dp_groups():
    # World of 6: DP group A = ranks 0-3 on two simulated nodes of 2, DP group B = ranks 4-5 (one node).
    # Every rank creates both groups (a world-wide collective), but only A's members build A's subgroups.
    a = dist.new_group([0, 1, 2, 3])
    b = dist.new_group([4, 5])
    mine, rpn = (a, 2) if dist.get_rank() < 4 else (b, None)
    model = mx.OverlappedDDP(torch.nn.Linear(5, 3), mx.OverlapConfig(bucket_size=100, ranks_per_node=rpn,
                                                                      grad_reduce="plain"), dp_group=mine)
    topo = model.topology
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.0), model)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    intra = dist.get_process_group_ranks(topo.intra_group) if topo.intra_group is not None else None
    inter = dist.get_process_group_ranks(topo.inter_group) if topo.inter_group is not None else None
    return topo.num_nodes, intra, inter


def test_subgroups_need_only_members(spawn):
    res = spawn(_two_dp_groups, 6, timeout=120)
    assert res[0] == (2, [0, 1], [0, 2])
    assert res[3] == (2, [2, 3], [1, 3])
    assert res[4] == (1, [4, 5], None)
