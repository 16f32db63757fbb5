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
