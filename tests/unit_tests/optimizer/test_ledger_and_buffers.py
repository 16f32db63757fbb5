"""Closed-form communication volumes of the plain backend, and buffer alternation bounds."""
import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx
from megatron_ext.optimizer.group_collectives import DP_SCALAR

from .models import make_mlp, make_model, odo_train_step, reference_training

# AwkwardNet parameters in reverse `parameters()` order (own params first, then children's):
# lin.bias, lin.weight, b7, wt, scale.
REVERSED_SIZES = [93, 1023, 7, 651, 1]


def _closed_form_buckets(bucket_size, dp, alignment=64):
    """Greedy buckets of whole params, each padded to dp * ceil(ceil(n / dp) / alignment) * alignment elements."""
    buckets, cur = [], 0
    for n in REVERSED_SIZES:
        if cur and cur + n > bucket_size:
            buckets.append(cur)
            cur = 0
        cur += n
    buckets.append(cur)
    return [dp * math.ceil(math.ceil(n / dp) / alignment) * alignment for n in buckets]


def _one_step_ledger(bucket_size, ranks_per_node):
    model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(bucket_size=bucket_size, ranks_per_node=ranks_per_node))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), model)
    model.ledger.reset()
    odo_train_step(model, opt, 0, dist.get_rank(), micro_batches=1)
    return model.ledger.summary(), [b.numel for b in model.buckets]


@pytest.mark.parametrize("bucket_size", [700, 10**6])
def test_plain_volumes_equal_closed_form(spawn, bucket_size):
    dp, rpn = 4, 2
    per_rank = spawn(_one_step_ledger, dp, bucket_size, rpn)
    padded = _closed_form_buckets(bucket_size, dp)
    for summary, numels in per_rank:
        assert numels == padded
        total_elems = sum(padded)
        # reduce-scatter of fp32 grads: each rank sends numel/dp * 4 bytes to every other rank,
        # (rpn - 1) of them on its node and (dp - rpn) on the other node.
        rs = summary["reduce_scatter"]
        assert rs["calls"] == len(padded)
        assert rs["intra"] == total_elems // dp * 4 * (rpn - 1)
        assert rs["inter"] == total_elems // dp * 4 * (dp - rpn)
        ag = summary["all_gather"]  # fp32 params: the same volume
        assert ag["calls"] == len(padded)
        assert (ag["intra"], ag["inter"]) == (rs["intra"], rs["inter"])
        # The grad-norm all-reduce ([norm^2, sync failed] in float64, 16 bytes): 2 * 16 / dp to each peer.
        sc = summary[DP_SCALAR]
        assert (sc["calls"], sc["intra"], sc["inter"]) == (1, 2 * 16 // dp * (rpn - 1), 2 * 16 // dp * (dp - rpn))
        assert set(summary) == {"reduce_scatter", "all_gather", DP_SCALAR, "total"}, "every collective is counted"


def _pool_run(pool_size, factory, overlap=True):
    model = mx.OverlappedDDP(factory(), mx.OverlapConfig(bucket_size=100, buffer_pool_size=pool_size,
                                                         accumulate="shard", overlap_grad_reduce=overlap))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                            clip_grad=0.05), model)
    for step in range(3):
        odo_train_step(model, opt, step, dist.get_rank(), micro_batches=3)
    model.force_param_sync()
    return (model.buffer_stats(), len(model.buckets), model.grad_sync.first_backward_order,
            {n: p.detach().clone() for n, p in model.module.named_parameters()})


@pytest.mark.parametrize("pool_size,overlap", [(1, True), (2, True), (2, False), (None, True)])
def test_buffer_alternation_bounds_live_buffers(spawn, pool_size, overlap):
    per_rank = spawn(_pool_run, 2, pool_size, make_mlp, overlap)
    pool_size = pool_size or 3   # auto: plain on CPU keeps three (OverlapConfig.resolved_buffer_pool_size)
    ref, _ = reference_training(2, 3, 3, 1e-2, 0.1, 0.05, factory=make_mlp)
    for stats, nbuckets, order, params in per_rank:
        assert nbuckets >= 6  # far more buckets than buffers
        assert order == sorted(order)
        # Overlap on: the pool is used up to its size. Off: each bucket's reduce-scatter is waited for as soon as
        # it is launched, so buffers never pile up either (one is enough for an in-order backward).
        assert (stats["peak"] == pool_size if overlap else stats["peak"] <= pool_size), stats
        assert stats["overflows"] == 0, stats
        assert stats["live"] == 0 and stats["pool_size"] == pool_size
        # Adam's update m / (sqrt(v) + eps) is O(lr) whatever the gradient's size; for an element whose
        # gradient nearly cancels across samples, fp32 reassociation (reduce-scatter vs one big batch) changes
        # it by up to ~1e-3 of its size. Bound: 1e-3 * lr per step, i.e. 3e-5 after 3 steps at lr=1e-2.
        for n, r in ref.items():
            torch.testing.assert_close(params[n], r, rtol=1e-5, atol=3e-5)


def test_buffer_pool_size_auto():
    from megatron_ext.optimizer.config import buffer_pool_size_for
    from megatron_ext.optimizer.plan_comm import sums_only_reduction
    from megatron_ext.optimizer.sharding import ShardingPlan
    # A third buffer on CPU where a bucket's reduction only sums between its messages (plain, ring).
    assert (buffer_pool_size_for(None, "cpu", True), buffer_pool_size_for(None, "cpu", False)) == (3, 2)
    assert (buffer_pool_size_for(None, "cuda", True), buffer_pool_size_for(None, "cuda", False)) == (2, 2)
    assert buffer_pool_size_for(5, "cpu", True) == 5
    cfg, cpu = mx.OverlapConfig(), torch.device("cpu")
    assert cfg.resolved_buffer_pool_size(cpu, True) == 3
    assert cfg.resolved_buffer_pool_size(torch.device("meta"), True) == 2   # meta: any device but the CPU
    assert mx.OverlapConfig(buffer_pool_size=5).resolved_buffer_pool_size(cpu, True) == 5
    for bad in (0, -1, 2.5, "3"):
        with pytest.raises(ValueError, match="buffer_pool_size"):
            mx.OverlapConfig(buffer_pool_size=bad)
    # DP 8 on nodes of 4: plain or the ring in one stage (ZeRO-2, ZeRO-3) only sums; a replica stage (MiCS) or a
    # quantized backend does more.
    def sums_only(plan, gr):
        return sums_only_reduction(plan.resolve(8, 4, 0), gr)
    assert sums_only(ShardingPlan(), "plain") and sums_only(ShardingPlan.zero3(), "plain")
    assert sums_only(ShardingPlan(), "ring") and sums_only(ShardingPlan.zero3(), "ring")
    assert not sums_only(ShardingPlan.mics(4), "plain") and not sums_only(ShardingPlan.mics(4), "ring")
    assert not sums_only(ShardingPlan(), "qgz") and not sums_only(ShardingPlan(), "bytegrad")


def test_out_of_order_backward_costs_buffers_not_correctness(spawn):
    # AwkwardNet's backward runs opposite to its registration order: buckets complete in reverse index order,
    # must still be launched in index order (same collective order on every rank), so extra buffers are needed.
    per_rank = spawn(_pool_run, 2, 1, make_model)
    ref, _ = reference_training(2, 3, 3, 1e-2, 0.1, 0.05)
    for stats, nbuckets, order, params in per_rank:
        assert order != sorted(order) and stats["overflows"] > 0 and stats["live"] == 0
        for n, r in ref.items():
            torch.testing.assert_close(params[n], r, rtol=1e-5, atol=1e-6)


class _RecomputedTail(torch.nn.Module):
    """A DeepMLP whose last two layers are recomputed in backward by a re-entrant checkpoint (megatron-core's full
    recomputation): the first gradients of each backward arrive inside a nested autograd graph task."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = make_mlp()

    def forward(self, x):
        layers = self.mlp.layers
        return torch.utils.checkpoint.checkpoint(layers[-2:], layers[:-2](x), use_reentrant=True)


def _rs_bytes_per_policy(micro_batches):
    out = {}
    for policy, factory in (("shard", make_model), ("local", make_model), ("auto", make_model),
                            ("mlp", make_mlp), ("mlp recomputed", _RecomputedTail)):
        model = mx.OverlappedDDP(factory(), mx.OverlapConfig(bucket_size=700 if factory is make_model else 300,
                                                             accumulate=policy if factory is make_model else "auto"))
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), model)
        model.ledger.reset()
        step = odo_train_step(model, opt, 0, dist.get_rank(), micro_batches=micro_batches)
        rs = model.ledger.summary()["reduce_scatter"]
        out[policy] = (rs["total"], model.grad_sync.last_step_mode, rs["calls"], step[1], len(model.buckets))
    return out


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_auto_accumulation_picks_the_cheaper_policy(spawn, micro_batches):
    res = spawn(_rs_bytes_per_policy, 2, micro_batches)[0]
    one = res["local"][0]
    assert res["shard"][0] == micro_batches * one      # reduce-scatter every micro-batch
    assert res["auto"][0] == one                        # never more traffic than local
    # M = 1: auto uses the pooled (bounded-memory) path; M > 1: the once-per-step local path.
    assert res["auto"][1] == ("pool" if micro_batches == 1 else "local")
    # Recomputation (a nested backward produces the first gradients) sends what the plain backward sends, one
    # reduce-scatter per bucket and synchronising micro-batch, for the same gradient norm: the micro-batch ends with
    # the outer backward ([Note: the backward's end]), not with the nested one (which launched half-full buckets).
    plain, recomputed = res["mlp"], res["mlp recomputed"]
    assert recomputed == plain and plain[4] > 2, (plain, recomputed)
    assert plain[2] == plain[4] * (micro_batches if plain[1] == "pool" else 1), plain


def _live_tensor_bytes() -> int:
    import gc

    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _memory_over_micro_batches(policy):
    from .models import batch

    model = mx.OverlappedDDP(make_mlp(), mx.OverlapConfig(bucket_size=100, accumulate=policy))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2), model)
    live = []
    for step in range(2):
        for i in range(6):   # every micro-batch synchronised: the shard accumulates a reduced scratch each time
            x, y = batch(step, dist.get_rank(), i)
            opt.scale_loss(torch.nn.functional.mse_loss(model(x), y)).backward()
            live.append(_live_tensor_bytes())
        model.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    return live


@pytest.mark.parametrize("policy", ["shard", "local"])
def test_memory_does_not_grow_with_micro_batches(spawn, policy):
    """A step of M synchronised micro-batches holds the same tensors after micro-batch 2 as after micro-batch 6
    (completed reductions release their scratch shard at once instead of at the end of the step)."""
    for live in spawn(_memory_over_micro_batches, 2, policy):
        assert live[2:6] == [live[2]] * 4 and live[8:12] == [live[8]] * 4, live   # (step 2 adds Adam state)


def _completion_order_with_a_later_bucket_needed_first():
    """A staged stand-in backend logs its hops. Two synchronised backwards without finish_grad_sync in between
    (local policy): the second uses only the first layer, whose bucket was launched *after* the second layer's, so
    it needs the later reduction finished first."""
    from megatron_ext.comm.backend import GradReduce, StagedWork, register_grad_reduce

    log, launches = [], []

    @register_grad_reduce("test_logged_hops")
    class LoggedHops(GradReduce):
        def reduce_scatter(self, bucket, out_shard):
            tag = f"launch{len(launches)}"   # launch 0 is the second layer's bucket (backward order)
            launches.append(tag)

            def finish():
                out_shard.copy_(bucket)
                log.append((tag, "done"))
                return []
            return StagedWork([lambda: log.append((tag, "hop1")) or [], lambda: log.append((tag, "hop2")) or [],
                               finish])

    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 24, bias=False), torch.nn.Linear(24, 4, bias=False)  # one bucket each
    module = torch.nn.ModuleDict({"first": first, "second": second})
    model = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=192, accumulate="local",
                                                      grad_reduce="test_logged_hops"))
    x = torch.randn(3, 8)
    second(first(x)).sum().backward()      # synchronised: both buckets launched, second's (100) first
    first(x).sum().backward()              # needs the first layer's buffer again: the later launch
    model.finish_grad_sync()
    return log


def test_a_bucket_waited_out_of_order_finishes_earlier_launches_first(spawn):
    """Whatever bucket forces a wait, the remaining hops are issued in launch order (the same on every rank)."""
    log = spawn(_completion_order_with_a_later_bucket_needed_first, 1)[0]
    assert log.index(("launch0", "done")) < log.index(("launch1", "done")), log
