"""The speculative step (megatron_ext/optimizer/speculative_step.py) at DP = 4 on 2 simulated nodes: the weights after
every step equal the usual step's bit for bit -- when rounds commit (no clipping), when they roll back (clipping,
a learning rate changed after the backward), when a forward, a checkpoint read or accumulation without no_sync()
interrupts them -- for the plain, qgZ, ByteGrad and qwZ backends, a plan with replicas and local accumulation;
buckets are really stepped in backward; random delays on the engine thread and in the hand-over never change the
weights or hang; a committed round sends the usual bytes; and what it cannot do is refused by name."""
from __future__ import annotations

import random
import time
import types

import pytest
import torch

from unit_tests.comm import _worlds as W
from unit_tests.dist_harness import run_distributed

DP, RPN = 4, 2
WIDTHS = [13, 37, 29, 5]


def _train(gr: str, pg: str, plan: str, spec: bool, clips, steps: int, *, engine: bool = True,
           misuse: bool = False, delays: bool = False, patience: float = 0.0):
    """``clips[step % len(clips)]`` is the step's clip_grad (0: none; 1e-4: every step clips). Returns the weights
    after every step, the rounds committed / rolled back, the buckets stepped in backward, one step's bytes and, per
    step, the weight gathers launched from its backward to its step's end: ``(bucket, on the speculative group)``
    in launch order."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx
    from megatron_ext.comm.progress import set_delay_hook
    from megatron_ext.optimizer import grad_sync

    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [m for a, b in zip(WIDTHS[:-1], WIDTHS[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())]
    module = torch.nn.Sequential(*layers[:-1])
    plans = {"zero2": mx.ShardingPlan(), "mics": mx.ShardingPlan.mics(RPN), "local": mx.ShardingPlan()}
    cfg = mx.OverlapConfig(bucket_size=200, grad_reduce=gr, param_gather=pg, ranks_per_node=RPN, quant_group_size=32,
                           sharding=plans[plan], accumulate="local" if plan == "local" else None,
                           progress_engine=engine, speculative_step=spec)
    model = mx.OverlappedDDP(module, cfg)
    launches, launch = [], model.param_sync.launch_buckets

    def recording(buckets, backend=None):
        launches.append([(b.index, backend is not None and backend is model.speculative_gather) for b in buckets])
        return launch(buckets, backend)
    model.param_sync.launch_buckets = recording
    ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=clips[0])
    opt = mx.OverlappedDistributedOptimizer(ocfg, model)
    rng = random.Random(1000 * rank + 7)
    if delays:
        set_delay_hook(lambda where: time.sleep(rng.random() * 0.003) if rng.random() < 0.3 else None)
    grad_sync.POLL_PATIENCE_S = patience
    weights, ledger_bytes, gathers = [], None, []
    try:
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(steps):
            launches.clear()   # (the last step's force_sync gathers)
            ocfg.clip_grad = clips[step % len(clips)]
            x, y = torch.randn(8, WIDTHS[0], generator=g), torch.randn(8, 5, generator=g)
            if step == 1:
                model.ledger.reset()
            if misuse and step == 4:
                start = {k: v.clone() for k, v in module.state_dict().items()}
            if step % 3 == 2:   # two micro-batches, accumulated inside no_sync() (or, misused, without it)
                with (model.no_sync() if not misuse else torch.enable_grad()):
                    torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
                if misuse and step == 5:
                    model.disable_forward_pre_hook(param_sync=False)   # the abort must not depend on the hooks
                torch.nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
                if misuse and step == 5:
                    model.enable_forward_pre_hook()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
            if misuse and step % 4 == 1:
                opt.param_groups[0]["lr"] *= 0.5    # after the backward: the round used the old value
            if misuse and step % 4 == 3:
                opt.state_dict()                    # a checkpoint read inside the round
            if misuse and step == 4:                # weights loaded inside the round (the step's own start)
                module.load_state_dict(start)
                opt.reload_model_params()
            model.finish_grad_sync()
            opt.step()
            gathers.append([item for call in launches for item in call])
            if step == 1:
                ledger_bytes = model.ledger.summary()
            opt.zero_grad()
            model.start_param_sync(force_sync=True)
            weights.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone())
    finally:
        set_delay_hook(None)
        grad_sync.POLL_PATIENCE_S = 0.0
    spec_objs = opt.speculation
    return {"weights": torch.stack(weights),
            "committed": sum(s.committed for s in spec_objs), "rolled_back": sum(s.rolled_back for s in spec_objs),
            "in_backward": sum(s.in_backward for s in spec_objs), "speculated": sum(len(s.buckets) for s in spec_objs),
            "ledger": ledger_bytes, "gathers": gathers,
            "reduction_order": [b.index for s in spec_objs for b in s.buckets],
            "forward_order": [b.index for b in model.param_sync.forward_order]}


# plain, qgZ, ByteGrad and qwZ; a plan with replicas (chained reduce-scatter + all-reduce); local accumulation
CASES = [("plain", "plain", "zero2"), ("qgz", "qwz", "zero2"), ("bytegrad", "plain", "mics"), ("qgz", "plain", "local")]
STEPS = 6   # steps 2 and 5 have two micro-batches


def _cases(cases, clips, **kw):
    W.capture_logs()
    out = {}
    for gr, pg, plan in cases:
        key = f"{gr}+{pg}/{plan}"
        out[key] = {"usual": _train(gr, pg, plan, False, clips, STEPS, **kw),
                    "spec": _train(gr, pg, plan, True, clips, STEPS, **kw)}
    return out


def _assert_same(res, what):
    for key, r in res[0].items():
        for rank_res in res:
            a, b = rank_res[key]["usual"]["weights"], rank_res[key]["spec"]["weights"]
            assert torch.equal(a, b), (f"{key} ({what}): first step that differs "
                                       f"{int((a != b).any(dim=1).nonzero()[0])}")


def test_committed_rounds_give_the_usual_weights_bit_for_bit():
    """No clipping: every round commits; plain's reductions are waited for in the hand-over (the test's patience),
    so its buckets are stepped in backward, all of them."""
    res = run_distributed(_cases, DP, CASES, [0.0], patience=0.05, timeout=600)
    _assert_same(res, "commit")
    for key, r in res[0].items():
        assert r["spec"]["committed"] == STEPS and r["spec"]["rolled_back"] == 0, (key, r["spec"])
        assert r["usual"]["committed"] == 0
        if key.startswith("plain+plain/zero2"):
            assert r["spec"]["in_backward"] == STEPS * r["spec"]["speculated"] > 0, (key, r["spec"])
        assert r["spec"]["in_backward"] > 0, (key, r["spec"])
        _assert_order(r["spec"], key)
        # A committed round sends the usual bytes, and one more scalar all-reduce (the round's agreed length).
        spec, usual = dict(r["spec"]["ledger"]), dict(r["usual"]["ledger"])
        s_scalar, u_scalar = spec.pop("dp_scalar_all_reduce"), usual.pop("dp_scalar_all_reduce")
        spec.pop("total"), usual.pop("total")
        assert spec == usual, key
        assert s_scalar["calls"] == u_scalar["calls"] + 1, (key, s_scalar, u_scalar)
        # the usual step's one scalar all-reduce carries two float64 (the norm's sum of squares, the failure flag)
        assert u_scalar["calls"] == 1 and s_scalar["total"] - u_scalar["total"] == u_scalar["total"] // 2, key


def _assert_order(r, key):
    """*Order*: in every committed step each bucket is gathered once; the speculative group gathers a prefix of the
    reduction order, the original group the rest, in forward order."""
    order, forward = r["reduction_order"], r["forward_order"]
    for step, gathers in enumerate(r["gathers"]):
        assert sorted(i for i, _ in gathers) == sorted(forward), (key, step, gathers)
        spec = [i for i, on_spec in gathers if on_spec]
        assert spec == order[:len(spec)], (key, step, spec, order)
        assert [i for i, on_spec in gathers if not on_spec] == [i for i in forward if i not in spec], (key, step)
    assert any(on_spec for gathers in r["gathers"] for _, on_spec in gathers), key   # the backward gathered some


def _clip_and_interrupted():
    cases = [("plain", "plain", "zero2"), ("qgz", "qwz", "zero2")]
    return {"clip": _cases(cases, [0.0, 1e-4], patience=0.05),
            "misuse": _cases(cases, [0.0], misuse=True, patience=0.05)}


def test_rounds_roll_back_exactly_when_the_norm_clips_or_the_round_is_interrupted():
    """Steps alternating between no clipping and clipping at 1e-4 (every norm above it): half commit, half roll
    back. Then accumulation without no_sync() (a forward inside the round, once with the waiting hooks off), a
    learning rate changed after the backward, a state_dict() read and a load_state_dict() + reload_model_params()
    inside the round: each rolls back. The weights are the usual ones throughout."""
    res = run_distributed(_clip_and_interrupted, DP, timeout=600)
    _assert_same([r["clip"] for r in res], "clip")
    _assert_same([r["misuse"] for r in res], "misuse")
    for key, r in res[0]["clip"].items():
        assert r["spec"]["committed"] == STEPS // 2 and r["spec"]["rolled_back"] == STEPS // 2, (key, r["spec"])
    # rolled back: steps 1, 5 (lr), 2, 5 (a forward; at 5 with the waiting hooks off), 3 (state_dict), 4 (reload)
    for key, r in res[0]["misuse"].items():
        assert r["spec"]["rolled_back"] == 5 and r["spec"]["committed"] == 1, (key, r["spec"])


def test_random_delays_never_change_the_weights_or_hang():
    """Random delays on the engine thread and in the hand-over (its patience) move *when* buckets are stepped,
    never which collectives each group sees: 12 steps, weights equal to the usual step's."""
    res = run_distributed(_delays_variants, DP, timeout=600)
    _assert_same(res, "delays")


def _delays_variants():
    import torch.distributed as dist
    W.capture_logs()
    out = {}
    for gr, pg, plan in [("qgz", "qwz", "zero2"), ("bytegrad", "plain", "mics")]:
        key = f"{gr}+{pg}/{plan}"
        rng = random.Random(dist.get_rank())
        out[key] = {"usual": _train(gr, pg, plan, False, [0.0, 0.0, 1e-4], 12),
                    "spec": _train(gr, pg, plan, True, [0.0, 0.0, 1e-4], 12, delays=True,
                                   patience=rng.random() * 0.004)}
    return out


def _refusals():
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx

    out = {}
    module = torch.nn.Linear(8, 8)
    for name, kw in {"zero3": dict(sharding=mx.ShardingPlan.zero3(dist.get_world_size())),
                     "no overlap": dict(overlap_param_gather=False)}.items():
        try:
            mx.OverlappedDDP(torch.nn.Linear(8, 8), mx.OverlapConfig(speculative_step=True, **kw))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    per_token = torch.nn.Linear(8, 8)
    per_token.config = types.SimpleNamespace(calculate_per_token_loss=True)
    try:
        mx.OverlappedDDP(per_token, mx.OverlapConfig(speculative_step=True))
        out["per-token loss"] = None
    except ValueError as e:
        out["per-token loss"] = str(e)
    model = mx.OverlappedDDP(module, mx.OverlapConfig(speculative_step=True))
    try:
        mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True), model)
        out["fp16"] = None
    except ValueError as e:
        out["fp16"] = str(e)
    second = mx.OverlappedDDP(torch.nn.Linear(8, 8), mx.OverlapConfig(speculative_step=True))
    try:
        mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model, second])
        out["two chunks"] = None
    except ValueError as e:
        out["two chunks"] = str(e)
    return out


def test_what_it_cannot_do_is_refused_by_name():
    res = run_distributed(_refusals, 2)
    for r in res:
        for name, msg in r.items():
            assert msg is not None and "--odo-speculative-step" in msg, (name, msg)
        assert "ZeRO-1/2" in r["zero3"] and "--overlap-param-gather" in r["no overlap"] and "--fp16" in r["fp16"]
        assert "--calculate-per-token-loss" in r["per-token loss"] and "one model chunk" in r["two chunks"]
