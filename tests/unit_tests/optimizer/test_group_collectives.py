"""Scalar and model-parallel collectives run on a device the process group serves, and are in the ledger.

A CUDA machine is not needed to check the decision: NCCL is "a group that serves only CUDA", and a ``cpu:gloo``
world is a real group that serves only CPU, so the optimizer's every all-reduce can be checked against the devices
its group accepts.
"""
import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx
from megatron_ext.optimizer.group_collectives import (DP_SCALAR, choose_device, collective_device,
                                                      device_types_from_backend, group_device_types)

from .models import batch, make_model


def test_backend_device_types():
    assert device_types_from_backend("nccl") == {"cuda"}
    assert device_types_from_backend("gloo") == {"cpu", "cuda"}
    assert device_types_from_backend("cpu:gloo") == {"cpu"}
    assert device_types_from_backend("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    with pytest.raises(ValueError, match="unknown process-group backend"):
        device_types_from_backend("carrier-pigeon")


def test_scalars_go_where_the_group_can_reduce_them():
    cpu, gpu1 = torch.device("cpu"), torch.device("cuda", 1)
    # NCCL: CPU-side values (the old code's torch.zeros(1)) move to the current CUDA device; CUDA ones stay.
    assert choose_device({"cuda"}, cpu, cuda_index=3) == torch.device("cuda", 3)
    assert choose_device({"cuda"}, gpu1, cuda_index=3) == gpu1
    # A CPU-only group takes CUDA values on the CPU; gloo serves both, so nothing moves.
    assert choose_device({"cpu"}, gpu1, cuda_index=0) == cpu
    assert choose_device({"cpu", "cuda"}, gpu1, cuda_index=0) == gpu1
    with pytest.raises(ValueError, match=r"reduces tensors on \['cuda'\] only"):
        choose_device({"cuda"}, cpu, cuda_index=None)


def _step_on_cpu_only_group():
    world = dist.group.WORLD
    types = group_device_types(world)
    seen = []
    real_all_reduce = dist.all_reduce

    def checking_all_reduce(t, *args, **kwargs):
        group = kwargs.get("group") or world
        seen.append((t.device.type, sorted(group_device_types(group))))
        return real_all_reduce(t, *args, **kwargs)

    dist.all_reduce = checking_all_reduce
    try:
        model = mx.OverlappedDDP(make_model().half(), mx.OverlapConfig(bucket_size=500))
        opt = mx.OverlappedDistributedOptimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True, initial_loss_scale=2.0 ** 10, clip_grad=1.0,
                            log_num_zeros_in_grad=True), model)
        model.ledger.reset()
        ok, norm, zeros = _fp16_step(model, opt)
        state = opt.state_dict()
    finally:
        dist.all_reduce = real_all_reduce
    return (types, collective_device(world, torch.device("meta")), seen, ok, norm, zeros, state["step"],
            model.ledger.summary())


def _fp16_step(model, opt):
    x, y = batch(0, dist.get_rank(), 0)
    loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
    opt.scale_loss(loss).backward()
    out = opt.step()
    opt.zero_grad()
    return out


def test_optimizer_scalars_on_a_cpu_only_group(spawn):
    dp = 2
    for types, meta_goes_to, seen, ok, norm, zeros, step, ledger in spawn(_step_on_cpu_only_group, dp,
                                                                        backend="cpu:gloo"):
        assert types == {"cpu"} and meta_goes_to == torch.device("cpu")
        assert ok and norm > 0 and zeros is not None and step == 1
        # the wrapper's config agreement and same-model check, the optimizer's config agreement, then inf flag
        # (fp16), norm, zero count, checkpoint step: each on a device its group serves
        assert len(seen) == 7 and all(dev in group for dev, group in seen), seen
        # Ledger: [inf, failed] and [norm^2, failed] (2 x float64), zero count and step (1 x float64); each an
        # all-reduce in which a rank sends 2B/P bytes to each peer.
        row = ledger[DP_SCALAR]
        assert row["calls"] == 4, row
        assert row["intra"] == sum(math.ceil(2 * b / dp) * (dp - 1) for b in (16, 16, 8, 8)) and row["inter"] == 0


def _peers_by_layout():
    from megatron_ext.optimizer.group_collectives import node_peers, set_ranks_per_node

    out = {"local_world_size": node_peers(dist.group.WORLD)}   # the harness: LOCAL_WORLD_SIZE = 4, one node
    for rpn in (1, 2):
        set_ranks_per_node(rpn)   # pretrain_gpt --ranks-per-node simulating nodes
        out[rpn] = node_peers(dist.group.WORLD)
    set_ranks_per_node(None)
    out["reset"] = node_peers(dist.group.WORLD)
    return out


def test_model_parallel_peers_follow_simulated_nodes(spawn):
    """The ledger's intra/inter split of TP/PP reductions counts nodes as --ranks-per-node says (on one machine
    LOCAL_WORLD_SIZE is the whole world: a tied-embedding all-reduce between simulated nodes was logged intra-node)."""
    for out in spawn(_peers_by_layout, 4):
        assert out["local_world_size"] == out["reset"] == (3, 0)
        assert out[1] == (0, 3) and out[2] == (1, 2)
