"""Param groups from megatron-core's ``config_overrides``: the ODO trains like one process whose groups megatron-core's
own ``_get_param_groups`` built (same overrides, same scheduler), under ZeRO-1 and ZeRO-3; groups the DP ranks build
differently, and conflicting overrides, are errors; a checkpoint's groups are matched by key, never by position."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, ParamKey, ParamPredicate, _get_param_groups
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import megatron_ext as mx
from megatron_ext import ShardingPlan
from megatron_ext.optimizer.param_groups import match_saved_groups

from .models import make_tied, odo_tied_step, token_batch, tied_loss

STEPS, MICRO, LR, MIN_LR, WD, CLIP = 4, 2, 1e-2, 1e-3, 0.1, 0.5


def _model():
    model = make_tied()
    model.emb.weight.is_embedding_or_output_parameter = True   # megatron-core's GPTModel marks these
    return model


def _cases():
    one_d = ParamPredicate(name="1-D", fn=lambda p: len(p.shape) == 1)
    return {
        "decoupled": (dict(decoupled_lr=3e-2, decoupled_min_lr=2e-3), None),   # megatron-core's standard overrides
        "custom": ({}, {ParamKey(name="module.block.*.weight"): {"max_lr": 2e-2, "wd_mult": 0.5},
                        ParamKey(predicate=one_d): {"wd_mult": 0.0},
                        ParamKey(name="module.norm.*"): {"min_lr": 5e-3}}),
        "none": ({}, {}),   # megatron-core's way to ask for one group, decay everywhere
    }


def _config(extra):
    return OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP, **extra)


def _scheduler(opt):
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=1,
                                   lr_decay_steps=STEPS, lr_decay_style="linear", start_wd=WD, end_wd=WD,
                                   wd_incr_steps=STEPS, wd_incr_style="constant")


def _reference(extra, overrides, dp):
    model = _model()
    # megatron-core's own grouping (the oracle), over names as a wrapped chunk has them ("module." first)
    groups = _get_param_groups([torch.nn.ModuleDict({"module": model})], _config(extra), overrides)
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = _scheduler(opt)
    lrs = []
    for step in range(STEPS):
        opt.zero_grad()
        toks, tgts = zip(*[token_batch(step, r, i) for r in range(dp) for i in range(MICRO)])
        tied_loss(model, torch.cat(toks), torch.cat(tgts)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        lrs.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
        sched.step(1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, lrs


def _train(plans):
    rank, dp = dist.get_rank(), dist.get_world_size()
    out = {}
    for plan_name, plan in plans:
        for case, (extra, overrides) in _cases().items():
            model = mx.OverlappedDDP(_model(), mx.OverlapConfig(bucket_size=200, sharding=plan, ranks_per_node=dp))
            opt = mx.OverlappedDistributedOptimizer(_config(extra), model, config_overrides=overrides)
            sched = _scheduler(opt)
            lrs = []
            for step in range(STEPS):
                assert odo_tied_step(model, opt, step, rank, MICRO)[0]
                lrs.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
                sched.step(1)
            model.force_param_sync()
            out[(plan_name, case)] = ({n: p.detach().clone() for n, p in model.module.named_parameters()}, lrs,
                                      _reference(extra, overrides, dp))
    return out


def test_groups_train_like_megatron_cores_grouping(spawn):
    per_rank = spawn(_train, 2, [("zero1", ShardingPlan.zero1()), ("zero3", ShardingPlan.zero3())])
    for key, (params, lrs, (ref, ref_lrs)) in per_rank[0].items():
        assert lrs == ref_lrs, key   # the same groups, in the same order, on the same schedule
        for n, t in ref.items():     # the bound and reason of test_equivalence (fp32 sums in another order)
            torch.testing.assert_close(params[n], t, rtol=1e-5, atol=1e-6, msg=f"{key} {n}")
            assert torch.equal(params[n], per_rank[1][key][0][n]), (key, n)
    groups = {case: len(per_rank[0][("zero1", case)][1][0]) for case in _cases()}
    assert groups == {"decoupled": 3, "custom": 4, "none": 1}   # the cases mean something
    decoupled = per_rank[0][("zero1", "decoupled")][1][-1]
    assert len({lr for lr, _ in decoupled}) == 2   # the embedding's schedule differs from the rest


def _mismatch_and_conflict():
    model = mx.OverlappedDDP(_model(), mx.OverlapConfig(bucket_size=200))
    overrides = {ParamKey(name="module.norm.*"): {"max_lr": 0.5 if dist.get_rank() else 0.25}}
    errors = {}
    try:
        mx.OverlappedDistributedOptimizer(_config({}), model, config_overrides=overrides)
    except ValueError as e:
        errors["mismatch"] = str(e)
    conflict = {ParamKey(name="module.norm.*"): {"wd_mult": 0.5}, ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    try:
        mx.OverlappedDistributedOptimizer(_config({}), model, config_overrides=conflict)
    except ValueError as e:
        errors["conflict"] = str(e)
    return errors


def test_groups_differing_across_ranks_or_conflicting_are_named(spawn):
    for errors in spawn(_mismatch_and_conflict, 2):
        assert "param_groups" in errors["mismatch"] and "max_lr" in errors["mismatch"]
        assert "norm.bias" in errors["conflict"] and "wd_mult" in errors["conflict"]


def test_saved_groups_matched_by_key_not_position():
    ours = [{"overrides": None, "wd_mult": 1.0, "lr_mult": 1.0}, {"overrides": (("wd_mult", 0.0),), "wd_mult": 0.0,
                                                                  "lr_mult": 1.0}]
    keyed = [dict(ours[1], weight_decay=0.0), dict(ours[0], weight_decay=0.1)]
    assert match_saved_groups(keyed, ours) == [keyed[1], keyed[0]]
    # older checkpoints: no keys, the two default groups in the other order; matched by wd_mult
    old = [{"wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0}, {"wd_mult": 1.0, "lr_mult": 1.0,
                                                                    "weight_decay": 0.1}]
    assert match_saved_groups(old, ours) == [old[1], old[0]]
    # a key this run does not have restores nothing into that group
    assert match_saved_groups([dict(ours[0], overrides=(("max_lr", 1.0),))], ours) == [None, None]
