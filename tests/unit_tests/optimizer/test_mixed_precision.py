"""fp16 dynamic loss scaling (overflow skips the step everywhere) and bf16 params with fp32 masters."""
import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx

from .models import batch, make_model


def _poison_hook_factory():
    def hook(grad):
        if dist.get_rank() == 1 and getattr(hook, "armed", False):
            grad = grad.clone()
            grad.view(-1)[3] = float("inf")
        return grad
    return hook


def _fp16_injected_inf(plan=None):
    model_inner = make_model().half()
    hook = _poison_hook_factory()
    model_inner.lin.weight.register_hook(hook)   # runs before accumulation, on rank 1 only when armed
    model = mx.OverlappedDDP(model_inner, mx.OverlapConfig(bucket_size=500, sharding=plan or mx.ShardingPlan()))
    opt = mx.OverlappedDistributedOptimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, fp16=True, initial_loss_scale=2.0 ** 10, hysteresis=1,
                        clip_grad=1.0), model)
    results = []
    for step in range(3):
        hook.armed = step == 1
        x, y = batch(step, dist.get_rank(), 0)
        opt.scale_loss(torch.nn.functional.mse_loss(model(x.half()).float(), y)).backward()
        model.force_param_sync()
        before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        masters_before = [m.clone() for m in opt.masters]
        states_before = {id(k): {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.inner.state.items()}
        scale_before = opt.get_loss_scale().item()
        ok, norm, _ = opt.step()
        model.force_param_sync()
        unchanged = (all(torch.equal(before[n], p) for n, p in model.module.named_parameters())
                     and all(torch.equal(a, b) for a, b in zip(masters_before, opt.masters))
                     and all(torch.equal(states_before[id(k)][kk], vv) for k, v in opt.inner.state.items()
                             for kk, vv in v.items() if id(k) in states_before))
        results.append({"ok": ok, "norm": norm, "scale_before": scale_before,
                        "scale_after": opt.get_loss_scale().item(), "unchanged": unchanged})
        opt.zero_grad()
    return results


@pytest.mark.parametrize("plan", [None, mx.ShardingPlan.zero3()], ids=["zero2", "zero3"])
def test_fp16_inf_on_one_rank_skips_step_everywhere(spawn, plan):
    per_rank = spawn(_fp16_injected_inf, 2, plan)
    for r, res in enumerate(per_rank):
        assert res[0]["ok"] and not res[0]["unchanged"], f"rank {r}: clean step must update"
        assert res[1]["ok"] is False and res[1]["norm"] is None, f"rank {r}: overflow step must be skipped"
        assert res[1]["unchanged"], f"rank {r}: a skipped step must leave weights, masters and state untouched"
        assert res[1]["scale_after"] == res[1]["scale_before"] / 2, f"rank {r}: loss scale must back off"
        assert res[2]["ok"], f"rank {r}: training resumes after the skipped step"
    assert [r["ok"] for r in per_rank[0]] == [r["ok"] for r in per_rank[1]]


def _bf16_regression():
    torch.manual_seed(0)
    true_w = torch.randn(16, 4)
    model = mx.OverlappedDDP(torch.nn.Linear(16, 4).to(torch.bfloat16), mx.OverlapConfig(bucket_size=32))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=3e-2, bf16=True, clip_grad=0.0),
                                            model)
    assert model.param_buffer.flat[torch.bfloat16].dtype == torch.bfloat16 and opt.masters[0].dtype == torch.float32
    losses = []
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(150):
        x = torch.randn(32, 16, generator=g)
        y = x @ true_w
        loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        opt.scale_loss(loss).backward()
        ok, _, _ = opt.step()
        assert ok
        opt.zero_grad()
        losses.append(loss.item())
    model.force_param_sync()
    # bf16 weights are the cast of the fp32 masters on every rank
    w = model.module.weight.detach().float().reshape(-1)
    return losses[0], sum(losses[-10:]) / 10, w


def test_bf16_params_with_fp32_master_converge(spawn):
    (first0, last0, w0), (first1, last1, w1) = spawn(_bf16_regression, 2)
    assert torch.equal(w0, w1)
    assert last0 < 0.02 * first0, (first0, last0)


def _fp16_injected_inf_on_one_tp_rank():
    """Two ranks as one TP group (DP = 1 each): only the model-parallel reduction links them."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        return _fp16_injected_inf()
    finally:
        ps.destroy_model_parallel()


def test_fp16_inf_on_one_tensor_parallel_rank_skips_step_on_the_other(spawn):
    per_rank = spawn(_fp16_injected_inf_on_one_tp_rank, 2)
    for r, res in enumerate(per_rank):
        assert res[0]["ok"] and res[2]["ok"], f"rank {r}: clean steps must update"
        assert res[1]["ok"] is False and res[1]["unchanged"], f"rank {r}: the inf on TP rank 1 must skip the step"
        assert res[1]["scale_after"] == res[1]["scale_before"] / 2


def _fp16_odo(initial_scale: float):
    model = mx.OverlappedDDP(make_model().half(), mx.OverlapConfig(bucket_size=500))
    opt = mx.OverlappedDistributedOptimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, fp16=True, initial_loss_scale=initial_scale, hysteresis=1,
                        clip_grad=1.0), model)
    return model, opt


def _train_step(model, opt, step: int):
    x, y = batch(step, dist.get_rank(), 0)
    opt.scale_loss(torch.nn.functional.mse_loss(model(x.half()).float(), y)).backward()
    ok, _, _ = opt.step()
    opt.zero_grad()
    return ok


def _fp16_checkpoint_before_the_first_applied_step():
    from megatron_ext.optimizer.checkpoint import merge_optimizer_shards
    from megatron_ext.training.checkpoint_compat import check_optimizer_state

    model, opt = _fp16_odo(2.0 ** 24)   # every fp16 gradient overflows at this scale: the first step is skipped
    skipped = not _train_step(model, opt, 0)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, opt.state_dict())
    saved = merge_optimizer_shards(shards)
    model2, opt2 = _fp16_odo(2.0 ** 10)
    problems = check_optimizer_state(saved, opt2)
    opt2.load_state_dict(saved)
    fresh_state = len(opt2.inner.state) == 0
    same_scale = opt2.get_loss_scale().item() == opt.get_loss_scale().item()
    # Both go on from here with the same batches: the loaded optimizer must step exactly as the saving one.
    oks = [(_train_step(model, opt, s), _train_step(model2, opt2, s)) for s in range(1, 16)]
    model.force_param_sync()
    model2.force_param_sync()
    same = all(torch.equal(a, b) for a, b in zip(opt.masters, opt2.masters)) and all(
        torch.equal(p, q) for p, q in zip(model.module.parameters(), model2.module.parameters()))
    return skipped, saved["step"], problems, fresh_state, same_scale, oks, same


def test_fp16_checkpoint_saved_before_the_first_applied_step_loads(spawn):
    """fp16's first steps are skipped while the loss scale falls, so Adam has no state yet: such a checkpoint holds
    masters only, loads into a fresh optimizer (no state, the saved loss scale) and continues bit for bit."""
    for skipped, step, problems, fresh_state, same_scale, oks, same in spawn(_fp16_checkpoint_before_the_first_applied_step, 2):
        assert skipped and step == 0
        assert problems == [], problems
        assert fresh_state and same_scale
        assert any(a for a, _ in oks) and all(a == b for a, b in oks), oks
        assert same


def test_loss_scaler_state_across_constant_and_dynamic_runs():
    """A --loss-scale run keeps its own scale whatever the checkpoint's scaler was (megatron-core's constant
    scaler); a dynamic run resumed from a --loss-scale checkpoint takes its scale and starts its trackers afresh."""
    from megatron_ext.optimizer.grad_scaler import ConstantLossScaler, DynamicLossScaler

    dynamic = DynamicLossScaler(initial_scale=2.0 ** 18, hysteresis=3, growth_interval=10)
    dynamic.update(found_inf=True)
    constant = ConstantLossScaler(1024.0)
    constant.load_state_dict(dynamic.state_dict())
    assert constant.scale.item() == 1024.0
    fresh = DynamicLossScaler(initial_scale=2.0 ** 32, hysteresis=3, growth_interval=10)
    fresh.load_state_dict(ConstantLossScaler(512.0).state_dict())
    assert fresh.scale.item() == 512.0
    assert fresh.state_dict() == {"scale": 512.0, "growth_tracker": 0, "hysteresis_tracker": 3}
    resumed = DynamicLossScaler(hysteresis=3)
    resumed.load_state_dict(dynamic.state_dict())
    assert resumed.state_dict() == dynamic.state_dict()


def _zeros_with_a_tensor_parallel_duplicate():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    from ..test_utilities import Utils

    Utils.initialize_model_parallel(2, 1)
    try:
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(4, 3))           # split over TP: each rank's own rows
                set_tensor_model_parallel_attributes(self.w, True, 0, 1)
                self.norm = torch.nn.Parameter(torch.ones(3))           # a TP duplicate whose gradient is 0

            def forward(self, x):
                return (x @ self.w.t()).sum() + 0 * self.norm.sum()

        model = mx.OverlappedDDP(Net(), mx.OverlapConfig(), dp_group=ps.get_data_parallel_group())
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3,
                                                                log_num_zeros_in_grad=True), model)
        opt.scale_loss(model(torch.ones(2, 3))).backward()
        return opt.step()[2]
    finally:
        ps.destroy_model_parallel()


def test_count_zeros_counts_a_tensor_parallel_duplicate_once(spawn):
    """megatron-core's count_zeros_fp32 counts each element once, as the norm does: the duplicated norm's 3 zeros
    are counted on TP rank 0 only (the split weight has no zero gradient)."""
    assert spawn(_zeros_with_a_tensor_parallel_duplicate, 2) == [3, 3]
