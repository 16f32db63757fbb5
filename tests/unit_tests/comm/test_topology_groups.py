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


def _timeouts():
    import argparse

    from megatron.core import parallel_state as ps

    from megatron_ext.comm.topology import world_timeout
    from megatron_ext.training.initialize import init_model_parallel

    def timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    topo = mx.OverlappedDDP(torch.nn.Linear(5, 3), mx.OverlapConfig(ranks_per_node=2)).topology
    clone = topo.engine_clone("timeout-test")
    ours = [timeout(g) for g in (topo.intra_group, topo.inter_group, clone.group, clone.intra_group)]
    init_model_parallel(argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                           distributed_timeout_minutes=3, seed=1))
    try:
        core = [timeout(g) for g in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())]
    finally:
        ps.destroy_model_parallel()
    return world_timeout(), timeout(dist.group.WORLD), ours, core


def test_groups_keep_the_worlds_timeout():
    """A stalled peer must not hold the others for torch's 30-minute default: the ODO's subgroups (and the progress
    engine's clones) take the world's timeout (pretrain_gpt: --distributed-timeout-minutes), megatron-core's groups
    the flag's value."""
    import datetime

    from unit_tests.dist_harness import COLLECTIVE_TIMEOUT_S, run_distributed

    for found, world, ours, core in run_distributed(_timeouts, 4, timeout=120):
        assert found == world == datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        assert ours == [world] * 4
        assert core == [datetime.timedelta(minutes=3)] * 2
