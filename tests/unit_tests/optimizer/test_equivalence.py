"""The ODO with the plain backend in fp32 equals single-process training on the concatenated global batch."""
import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx

from .models import make_model, odo_train_step, reference_training

STEPS, MICRO, LR, WD, CLIP = 5, 3, 1e-2, 0.1, 0.05
CASES = [(bucket, policy, True) for bucket in (500, 10**6) for policy in ("shard", "local", "auto")]
CASES += [(500, "shard", False), (500, "local", False)]   # no overlap: grads reduced and params gathered eagerly


def _train_all_cases(optimizer):
    results = {}
    for bucket, policy, overlap in CASES:
        model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(bucket_size=bucket, accumulate=policy,
                                                                overlap_grad_reduce=overlap,
                                                                overlap_param_gather=overlap))
        opt = mx.OverlappedDistributedOptimizer(
            OptimizerConfig(optimizer=optimizer, lr=LR, weight_decay=WD, clip_grad=CLIP, sgd_momentum=0.9), model)
        norms = []
        for step in range(STEPS):
            ok, norm, _ = odo_train_step(model, opt, step, dist.get_rank(), MICRO)
            assert ok
            norms.append(norm)
        model.force_param_sync()
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        results[(bucket, policy, overlap)] = (params, norms, len(model.buckets))
    return results


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_plain_fp32_matches_single_process(spawn, dp):
    per_rank = spawn(_train_all_cases, dp, "adam")
    ref_params, ref_norms = reference_training(dp, MICRO, STEPS, LR, WD, CLIP)
    assert ref_norms[0] > CLIP, "clipping must be active for this test to mean anything"
    for case in CASES:
        params0, norms0, nbuckets = per_rank[0][case]
        if case[0] == 500:
            assert nbuckets > 1
        else:
            assert nbuckets == 1
        for r in range(1, dp):  # every rank holds the same weights
            for n in params0:
                assert torch.equal(params0[n], per_rank[r][case][0][n]), (case, r, n)
        # fp32 sums in a different order (reduce-scatter vs one big batch) differ by a few ulps per step;
        # Adam normalises by sqrt(v), which keeps such differences at the ulp level of the update.
        for n, ref in ref_params.items():
            torch.testing.assert_close(params0[n], ref, rtol=1e-5, atol=1e-6, msg=f"{case} {n}")
        torch.testing.assert_close(torch.tensor(norms0), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)


def test_sgd_matches_single_process(spawn):
    dp = 2
    per_rank = spawn(_train_all_cases, dp, "sgd")
    ref_params, _ = reference_training(dp, MICRO, STEPS, LR, WD, CLIP, optimizer="sgd")
    for case in CASES:
        for n, ref in ref_params.items():
            torch.testing.assert_close(per_rank[0][case][0][n], ref, rtol=1e-5, atol=1e-6, msg=f"{case} {n}")


def _train(dp_cases, steps, use_no_sync=True):
    results = {}
    for bucket, policy, overlap in dp_cases:
        model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(bucket_size=bucket, accumulate=policy,
                                                                overlap_grad_reduce=overlap))
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD,
                                                                clip_grad=CLIP), model)
        for step in range(steps):
            assert odo_train_step(model, opt, step, dist.get_rank(), MICRO, use_no_sync=use_no_sync)[0]
        model.force_param_sync()
        results[(bucket, policy, overlap)] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return results


SYNCED_CASES = [(500, "local", True), (500, "local", False), (10**6, "local", True), (500, "shard", True),
                (500, "auto", True)]


def test_every_micro_batch_synced_matches_single_process(spawn):
    # Without no_sync() every micro-batch is synchronised (megatron's schedules when no_sync_func is unset); the
    # local policy must then reduce each micro-batch's gradient exactly once, like shard.
    dp, steps = 2, 3
    per_rank = spawn(_train, dp, SYNCED_CASES, steps, use_no_sync=False)
    ref_params, _ = reference_training(dp, MICRO, steps, LR, WD, CLIP)
    for case in SYNCED_CASES:
        for n, ref in ref_params.items():   # same tolerance and reason as the DP 2-4 test above
            torch.testing.assert_close(per_rank[0][case][n], ref, rtol=1e-5, atol=1e-6, msg=f"{case} {n}")
            assert torch.equal(per_rank[0][case][n], per_rank[1][case][n])


@pytest.mark.parametrize("dp,policy", [(5, "shard"), (6, "local")])
def test_plain_fp32_matches_single_process_at_dp_5_and_6(spawn, dp, policy):
    # DP sizes that divide none of the awkward parameter sizes (1, 7, 93, 651, 1023): padding does all the work.
    steps, case = 3, (500, policy, True)
    per_rank = spawn(_train, dp, [case], steps)
    ref_params, _ = reference_training(dp, MICRO, steps, LR, WD, CLIP)
    for n, ref in ref_params.items():
        torch.testing.assert_close(per_rank[0][case][n], ref, rtol=1e-5, atol=1e-6, msg=f"dp={dp} {n}")
        assert all(torch.equal(per_rank[0][case][n], r[case][n]) for r in per_rank[1:])
