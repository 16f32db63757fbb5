"""Optimizer state in canonical per-parameter layout: exact resume at the same DP size, resharding to another."""
import os

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx
from megatron_ext.optimizer.checkpoint import merge_optimizer_shards

from .models import make_model

GLOBAL_BATCH = 12


def _global_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 11, generator=g), torch.randn(GLOBAL_BATCH, 7, generator=g)


def _step(model, opt, step):
    p, r = dist.get_world_size(), dist.get_rank()
    x, y = _global_batch(step)
    rows = slice(r * GLOBAL_BATCH // p, (r + 1) * GLOBAL_BATCH // p)
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    ok, _, _ = opt.step()
    assert ok
    opt.zero_grad()


def _run(bucket, first, last, ckpt_dir, save_at=None, load=None):
    model = mx.OverlappedDDP(make_model(seed=dist.get_world_size()), mx.OverlapConfig(bucket_size=bucket))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                            clip_grad=0.05), model)
    if load == "local":
        model.load_state_dict(torch.load(os.path.join(ckpt_dir, "model.pt")))
        opt.load_state_dict(torch.load(os.path.join(ckpt_dir, f"optim_{dist.get_rank()}.pt")))
    elif load == "canonical":
        model.load_state_dict(torch.load(os.path.join(ckpt_dir, "model.pt")))
        shards = [torch.load(os.path.join(ckpt_dir, f)) for f in sorted(os.listdir(ckpt_dir)) if f.startswith("optim_")]
        opt.load_state_dict(merge_optimizer_shards(shards))
    for step in range(first, last):
        if save_at is not None and step == save_at:
            sd = opt.state_dict()
            torch.save(sd, os.path.join(ckpt_dir, f"optim_{dist.get_rank()}.pt"))
            if dist.get_rank() == 0:
                torch.save(model.state_dict(), os.path.join(ckpt_dir, "model.pt"))
            dist.barrier()
        _step(model, opt, step)
    model.force_param_sync()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_exact_resume_and_reshard_dp4_to_dp2(spawn, tmp_path):
    straight = spawn(_run, 4, 100, 0, 5, str(tmp_path), 2)[0]        # saves before step 2
    resumed = spawn(_run, 4, 100, 2, 5, str(tmp_path), None, "local")[0]
    for n in straight:  # same DP size, same buckets: bit-exact
        assert torch.equal(straight[n], resumed[n]), n
    resharded = spawn(_run, 2, 10**6, 2, 5, str(tmp_path), None, "canonical")
    assert all(torch.equal(resharded[0][n], resharded[1][n]) for n in straight)
    for n in straight:  # another DP size and bucket layout: fp32 sums in another order only
        torch.testing.assert_close(resharded[0][n], straight[n], rtol=1e-5, atol=1e-6, msg=n)
    # the merged checkpoint really is canonical: one full tensor per parameter and state
    merged = merge_optimizer_shards([torch.load(tmp_path / f"optim_{r}.pt") for r in range(4)])
    for n, p in straight.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert merged["params"][n][key].shape == (p.numel(),)


def test_merge_rejects_incomplete_shards(tmp_path, spawn):
    spawn(_run, 2, 100, 0, 2, str(tmp_path), 1)
    shard = torch.load(tmp_path / "optim_0.pt")
    try:
        merge_optimizer_shards([shard])
    except ValueError as e:
        assert "incomplete" in str(e)
    else:
        raise AssertionError("merging one of two shards must fail")


def _sgd_momentum_resume():
    """Three SGD-with-momentum steps, a merged checkpoint loaded into a fresh optimizer, then both go on: SGD keeps
    no ``step``, so the saved momentum buffers must be found by themselves."""
    from megatron_ext.training.checkpoint_compat import check_optimizer_state

    def build():
        model = mx.OverlappedDDP(make_model(seed=0), mx.OverlapConfig(bucket_size=500))
        return model, mx.OverlappedDistributedOptimizer(
            OptimizerConfig(optimizer="sgd", lr=1e-2, sgd_momentum=0.9, clip_grad=0.0), model)

    model, opt = build()
    for step in range(3):
        _step(model, opt, step)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, opt.state_dict())
    saved = merge_optimizer_shards(shards)
    model2, opt2 = build()
    model2.load_state_dict(model.state_dict())
    problems = check_optimizer_state(saved, opt2)
    opt2.load_state_dict(saved)
    buffers = sum("momentum_buffer" in st for st in opt2.inner.state.values())
    for step in range(3, 5):
        _step(model, opt, step)
        _step(model2, opt2, step)
    same = all(torch.equal(a, b) for a, b in zip(opt.masters, opt2.masters))
    return problems, buffers, same


def test_sgd_momentum_survives_a_resume(spawn):
    for problems, buffers, same in spawn(_sgd_momentum_resume, 2):
        assert problems == [] and buffers > 0 and same, (problems, buffers, same)


def _mismatched_loads():
    """A state saved for other shapes or another optimizer: every rank raises ValueError naming the problem (or
    that another rank found one) before anything is loaded; nothing hangs."""
    def build(out_features, optimizer="adam"):
        torch.manual_seed(0)
        model = mx.OverlappedDDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, out_features)),
                                 mx.OverlapConfig(bucket_size=64))
        return model, mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer=optimizer, lr=1e-2), model)

    def grads_and_step(model, opt):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build(16)
    grads_and_step(model, opt)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, opt.state_dict())
    saved = merge_optimizer_shards(shards)
    out = []
    for out_features, optimizer in ((12, "adam"), (16, "sgd")):
        _, other = build(out_features, optimizer)
        masters = [m.clone() for m in other.masters]
        try:
            other.load_state_dict(saved)
            out.append("loaded")
        except ValueError as e:
            out.append(str(e))
        out.append(all(torch.equal(a, b) for a, b in zip(masters, other.masters)))   # untouched
    return out


def test_load_state_dict_refuses_other_shapes_and_optimizers_on_every_rank(spawn):
    for rank, (shape_err, shape_kept, type_err, type_kept) in enumerate(spawn(_mismatched_loads, 2)):
        assert shape_err.startswith("the optimizer state does not fit this optimizer"), (rank, shape_err)
        # each rank names the piece it owns, or says that the other rank found one
        assert "1.weight: optimizer state for 128 elements" in shape_err or "1.bias: optimizer state for 16" in (
            shape_err) or "another rank" in shape_err, shape_err
        assert "the optimizer state is for Adam" in type_err and "SGD" in type_err, (rank, type_err)
        assert shape_kept and type_kept


def test_checkpoints_record_the_update_rule_not_the_implementation():
    """apex's FusedAdam (what a CUDA host with apex builds) is AdamW or Adam by its mode: a state saved by torch's
    AdamW on a CPU host (or imported from Megatron-LM) loads into it and back; Adam and AdamW stay apart, and states
    saved before the rule was recorded (apex's class name) load into either."""
    from megatron_ext.optimizer.inner_optimizer import same_update_rule, update_rule

    class FusedAdam(torch.optim.Optimizer):   # apex's name and mode flag, without apex
        def __init__(self, adam_w_mode):
            super().__init__([torch.zeros(1, requires_grad=True)], {})
            self.adam_w_mode = adam_w_mode

    params = [torch.zeros(1, requires_grad=True)]
    adamw, adam, sgd = torch.optim.AdamW(params), torch.optim.Adam(params), torch.optim.SGD(params, lr=0.1)
    assert [update_rule(o) for o in (FusedAdam(1), FusedAdam(0), adamw, adam, sgd)] == [
        "AdamW", "Adam", "AdamW", "Adam", "SGD"]
    assert same_update_rule("AdamW", FusedAdam(1)) and same_update_rule(update_rule(FusedAdam(1)), adamw)
    assert not same_update_rule("AdamW", FusedAdam(0)) and not same_update_rule("Adam", adamw)
    assert same_update_rule("FusedAdam", adamw) and same_update_rule("FusedAdam", adam)
    assert not same_update_rule("FusedAdam", sgd) and not same_update_rule("SGD", adamw)
