"""The planner's closed forms against the ODO itself: for every plan and backend combination that runs here, the
predicted bytes per ledger row equal ``model.ledger`` and the predicted model-state bytes equal
``model.memory_report()``, on every rank (from the parameter numels alone: the planner never sees the model)."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx
from megatron_ext.planner.candidate import Candidate
from megatron_ext.planner.memory import TrainingSetup, bucket_shapes, model_state_memory, plan_alignment
from megatron_ext.planner.volumes import WireOptions, ledger_rows, step_calls

from unit_tests.optimizer.models import make_tied, odo_tied_step

BUCKET, GROUP = 300, 64

# (param, grad, optim, hpz, grad_reduce, param_gather) for DP 8 on nodes of 2 ranks: every plan family, every
# backend, stages that are node-local, span nodes, and run across replicas.
CASES = [
    (1, 8, 8, 1, "plain", "plain"),     # ZeRO-2
    (1, 1, 8, 1, "plain", "plain"),     # ZeRO-1
    (1, 2, 2, 1, "plain", "plain"),     # MiCS in a node
    (1, 1, 2, 1, "plain", "plain"),     # AMSP 7B
    (1, 4, 4, 1, "qgz", "qwz"),         # MiCS over 2 nodes, quantized, replicated across 2
    (1, 1, 2, 1, "bytegrad", "plain"),  # replicas reduced by ByteGrad
    (1, 8, 8, 1, "qgz", "plain"),       # qgZ over the whole group
    (1, 2, 2, 1, "qgz", "qwz"),         # node-local optim, qgZ across the replicas
    (1, 8, 8, 1, "bytegrad", "qwz"),
    (8, 8, 8, 1, "plain", "plain"),     # ZeRO-3
    (8, 8, 8, 2, "qgz", "qwz"),         # ZeRO++
    (2, 2, 2, 1, "plain", "plain"),     # ZeRO-3 inside a node, replicated
    (1, 8, 8, 1, "ring", "plain"),      # the ring over the whole group (the node's last rank crosses)
    (1, 4, 4, 1, "ring", "plain"),      # MiCS over 2 nodes: ring in the optim group and across the replicas
]
MICRO = 2


def _cand(case) -> Candidate:
    p, g, o, h, gr, pg = case
    return Candidate(p, g, o, h, gr, pg, 4, BUCKET)


def _run(rpn: int):
    rank = dist.get_rank()
    out = {}
    for case in CASES:
        cand = _cand(case)
        model = mx.OverlappedDDP(make_tied(), mx.OverlapConfig(
            bucket_size=BUCKET, sharding=cand.sharding_plan(), ranks_per_node=rpn, grad_reduce=cand.grad_reduce,
            param_gather=cand.param_gather, quant_group_size=GROUP, grad_reduce_in_fp32=True))
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3), model)
        for step in range(2):   # ZeRO-3 records its schedule in the first step; pools and states exist after it
            assert odo_tied_step(model, opt, step, rank, MICRO)[0]
        model.ledger.reset()
        assert odo_tied_step(model, opt, 2, rank, MICRO)[0]
        model.param_sync.wait_all()
        rows = {k: [v["intra"], v["inter"]] for k, v in model.ledger.summary().items()
                if k not in ("total", "dp_scalar_all_reduce")}
        mem = model.memory_report()
        out[case] = {"rows": rows, "memory": {k: v for k, v in mem.items() if k != "gather_pool"},
                     "numels": [p.numel() for p in model.module.parameters()],
                     "align": model.buckets[0].shard_numel and _alignment(model)}
    return out


def _alignment(model) -> int:
    import math
    return math.lcm(model.overlap_config.shard_alignment, model.comm.shard_alignment)


def test_volumes_and_memory_equal_the_odo():
    from unit_tests.dist_harness import run_distributed
    dp, rpn = 8, 2
    per_rank = run_distributed(_run, dp, rpn)
    # device="cpu": the planner's pool depth is the wrapper's own on gloo (3 buffers for a sums-only reduction).
    setup = TrainingSetup(params_dtype="fp32", grad_reduce_in_fp32=True, quant_group_size=GROUP, device="cpu")
    wire = WireOptions(param_bytes=4, grad_bytes=4, quant_group_size=GROUP)
    for rank, result in enumerate(per_rank):
        for case, got in result.items():
            cand = _cand(case)
            plan = cand.sharding_plan().resolve(dp, rpn, rank)
            assert plan_alignment(cand, plan, setup) == got["align"], case
            buckets, data = bucket_shapes(got["numels"], cand, plan, setup)
            predicted = {k: v for k, v in ledger_rows(step_calls(cand, plan, buckets, MICRO, wire)).items()
                         if v != [0, 0]}
            measured = {k: v for k, v in got["rows"].items() if v != [0, 0]}
            assert predicted == measured, (case, rank)
            assert model_state_memory(cand, plan, buckets, data, setup, MICRO) == got["memory"], (case, rank)


def test_replayed_pool_buffers_follow_the_ring_and_not_plain():
    """The time replay issues plain's collectives one at a time (what gloo's third buffer restores), so it replays 2
    for plain; the ring's third buffer on CPU lets backward run ahead of its hops, which the replay models: 3."""
    from megatron_ext.optimizer.sharding import ShardingPlan
    plan = ShardingPlan().resolve(8, 4, 0)
    cpu, gpu = TrainingSetup(device="cpu"), TrainingSetup(device="cuda")
    assert cpu.pool_buffers(plan, "plain") == cpu.pool_buffers(plan, "ring") == 3
    assert (cpu.replayed_pool_buffers(plan, "plain"), cpu.replayed_pool_buffers(plan, "ring")) == (2, 3)
    assert gpu.replayed_pool_buffers(plan, "ring") == 2 and cpu.replayed_pool_buffers(plan, "qgz") == 2
    assert TrainingSetup(device="cpu", buffer_pool_size=5).replayed_pool_buffers(plan, "plain") == 5
