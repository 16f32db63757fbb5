"""Overlapped param gather never exposes stale weights; bad configuration fails before any collective."""
import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx

from .models import make_mlp, odo_train_step


def _overlapped_gather_is_lazy_and_fresh():
    torch.manual_seed(0)
    model = mx.OverlappedDDP(make_mlp(), mx.OverlapConfig(bucket_size=100, overlap_param_gather=True))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), model)
    odo_train_step(model, opt, 0, dist.get_rank(), micro_batches=1)
    nb = len(model.buckets)
    pending_after_step = model.param_sync.pending
    # Record how many gathers are still pending when each layer starts: they must be waited bucket by bucket.
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(model.param_sync.pending))
             for layer in model.module.layers]
    x = torch.randn(4, 11)
    with torch.no_grad():
        out_overlapped = model(x)
    for h in hooks:
        h.remove()
    model.force_param_sync()
    with torch.no_grad():
        out_synced = model(x)
    # Weights every rank holds after the gather are the owners' masters, cast.
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    return nb, pending_after_step, seen, torch.equal(out_overlapped, out_synced), flat


def test_param_gather_overlaps_forward_without_stale_reads(spawn):
    per_rank = spawn(_overlapped_gather_is_lazy_and_fresh, 2)
    for nb, pending, seen, same, _ in per_rank:
        assert pending == nb, "all gathers are in flight after step (waited lazily, not eagerly)"
        # Each layer waits only for its own two buckets (weight, bias): the rest stay in flight.
        assert seen == [nb - 2 * i for i in range(len(seen))], seen
        assert same, "forward with lazily waited gathers must equal forward after a forced sync"
    assert torch.equal(per_rank[0][4], per_rank[1][4])


def _expect_error(kind):
    cfgs = {
        "bucket": lambda: mx.OverlapConfig(bucket_size=0),
        "accumulate": lambda: mx.OverlapConfig(accumulate="sometimes"),
        "grad_reduce": lambda: mx.OverlappedDDP(torch.nn.Linear(3, 3), mx.OverlapConfig(grad_reduce="magic")),
        "param_gather": lambda: mx.OverlappedDDP(torch.nn.Linear(3, 3), mx.OverlapConfig(param_gather="magic")),
        "ranks_per_node": lambda: mx.OverlappedDDP(torch.nn.Linear(3, 3), mx.OverlapConfig(ranks_per_node=2)),
        "optimizer": lambda: mx.OverlappedDistributedOptimizer(
            OptimizerConfig(optimizer="lion", lr=1.0),
            mx.OverlappedDDP(torch.nn.Linear(3, 3), mx.OverlapConfig())),
    }
    try:
        cfgs[kind]()
    except (ValueError, TypeError) as e:
        msg = str(e)
    else:
        msg = None
    # The world is still healthy: no rank is stuck in a half-started collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    return msg, t.item()


@pytest.mark.parametrize("kind,flag", [("bucket", "--ddp-bucket-size"), ("accumulate", "--odo-accumulate"),
                                       ("grad_reduce", "--grad-reduce"), ("param_gather", "--param-gather"),
                                       ("ranks_per_node", "--ranks-per-node"), ("optimizer", "--optimizer")])
def test_bad_configuration_names_the_flag(spawn, kind, flag):
    world = 3  # ranks_per_node=2 does not divide 3
    for msg, total in spawn(_expect_error, world, kind):
        assert msg is not None and flag in msg, msg
        assert total == world
