"""Sharding plans (ZeRO-1/2, MiCS/HSDP-like, AMSP's 7B plan, mixed): equivalence with single-process training,
closed-form ledger volumes, the memory formula, cross-plan checkpoints and up-front rejection of invalid plans."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx
from megatron_ext import ShardingPlan
from megatron_ext.optimizer.checkpoint import merge_optimizer_shards
from megatron_ext.optimizer.memory import model_state_bytes

from unit_tests.dist_harness import run_distributed

from .models import make_model, odo_train_step, reference_training

STEPS, LR, WD, CLIP, BUCKET = 3, 1e-2, 0.1, 0.05, 500


def plans_for(rpn: int, dp: int) -> dict:
    """Named plans for a DP group with ``rpn`` ranks per node (mixed: one spanning nodes, one inside a node)."""
    out = {"zero2": ShardingPlan.zero2(), "zero1": ShardingPlan.zero1(), "amsp_7b": ShardingPlan.amsp_7b(rpn),
           "mics": ShardingPlan.mics(rpn), "auto_node_optim": ShardingPlan(optim=rpn)}
    span = 2 * rpn if 2 * rpn < dp else None
    if span:
        out["mixed_span_grad1"] = ShardingPlan(grad=1, optim=span)
        out["mixed_span_shard"] = ShardingPlan(grad=span, optim=span)
    if rpn % 2 == 0 and rpn > 2:
        out["mixed_subnode"] = ShardingPlan(grad=rpn // 2, optim=rpn // 2)
    return out


def _train_plans(rpn: int, optimizer: str, micro_list, names=None):
    rank = dist.get_rank()
    results = {}
    for name, plan in plans_for(rpn, dist.get_world_size()).items():
        if names is not None and name not in names:
            continue
        for micro in micro_list:
            model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(bucket_size=BUCKET, sharding=plan,
                                                                    ranks_per_node=rpn))
            opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(
                optimizer=optimizer, lr=LR, weight_decay=WD, clip_grad=CLIP, sgd_momentum=0.9), model)
            norms = []
            for step in range(STEPS):
                ok, norm, _ = odo_train_step(model, opt, step, rank, micro)
                assert ok
                norms.append(norm)
            model.force_param_sync()
            results[(name, micro)] = ({n: p.detach().clone() for n, p in model.module.named_parameters()}, norms,
                                      model.plan.replicas)
    return results


@functools.lru_cache(maxsize=None)
def _reference(dp: int, micro: int, optimizer: str):
    return reference_training(dp, micro, STEPS, LR, WD, CLIP, optimizer=optimizer)


def _check_equivalence(per_rank, dp, optimizer):
    assert per_rank[0], "no plan ran"
    for (name, micro), (params0, norms0, _) in per_rank[0].items():
        ref_params, ref_norms = _reference(dp, micro, optimizer)
        for r in range(1, dp):   # replicas and shards: every rank holds bit-identical weights
            for n in params0:
                assert torch.equal(params0[n], per_rank[r][(name, micro)][0][n]), (name, micro, r, n)
        # Same bound and reason as test_equivalence: fp32 sums in another order differ by ulps per step.
        for n, ref in ref_params.items():
            torch.testing.assert_close(params0[n], ref, rtol=1e-5, atol=1e-6, msg=f"{name} M={micro} {n}")
        torch.testing.assert_close(torch.tensor(norms0), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rpn", [2, 4])
def test_plans_match_single_process_adam_dp8(spawn, rpn):
    per_rank = spawn(_train_plans, 8, rpn, "adam", (1, 3))
    assert {k[0] for k in per_rank[0]} == set(plans_for(rpn, 8))
    assert max(v[2] for v in per_rank[0].values()) > 1, "some plan must replicate its optimizer shards"
    _check_equivalence(per_rank, 8, "adam")


def test_plans_match_single_process_sgd_dp8(spawn):
    per_rank = spawn(_train_plans, 8, 2, "sgd", (1, 3), ("zero1", "amsp_7b", "mics", "mixed_span_grad1"))
    _check_equivalence(per_rank, 8, "sgd")


def test_plans_match_single_process_dp6_three_per_node(spawn):
    per_rank = spawn(_train_plans, 6, 3, "adam", (1, 3), ("zero1", "amsp_7b", "mics", "auto_node_optim"))
    _check_equivalence(per_rank, 6, "adam")


# -- ledger and memory: the closed forms for the actual padded buckets ------------------------------------------
def _ledger_and_memory(rpn: int, micro: int):
    rank = dist.get_rank()
    out = {}
    for name, plan in plans_for(rpn, dist.get_world_size()).items():
        model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(bucket_size=BUCKET, sharding=plan,
                                                                ranks_per_node=rpn, buffer_pool_size=2))
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=LR, clip_grad=CLIP), model)
        odo_train_step(model, opt, 0, rank, micro)   # the pool and the Adam state exist after one step
        model.ledger.reset()
        odo_train_step(model, opt, 1, rank, micro)
        model.force_param_sync()
        owned = sum(pc.end - pc.start for pc in opt.pieces)
        out[name] = {"ledger": model.ledger.summary(), "memory": model.memory_report(), "owned": owned,
                     "shards": [b.shard_numel for b in model.buckets], "numel": [b.numel for b in model.buckets],
                     "optim": model.plan.optim, "replicas": model.plan.replicas,
                     "mode": model.grad_sync.last_step_mode, "total": sum(p.numel() for p in model.parameters())}
    return out


def _peers(size: int, per_node: int):
    return per_node - 1, size - per_node


def expected_bucket_bytes(info: dict, rpn: int, micro: int) -> dict:
    """Bytes one rank sends per step: reduce-scatter (fp32) and all-gather (fp32 weights) inside the optim group,
    all-reduce across the replicas (2B/R to each peer); per micro-batch in pool mode, once otherwise."""
    o, R = info["optim"], info["replicas"]
    o_in, o_out = _peers(o, min(o, rpn))
    r_in, r_out = _peers(R, max(1, min(R, rpn // o)))
    rs_calls = micro if info["mode"] == "pool" else 1
    exp = {"reduce_scatter": [0, 0], "all_reduce": [0, 0], "all_gather": [0, 0]}
    for n in info["shards"]:
        if o > 1:
            exp["reduce_scatter"][0] += rs_calls * o_in * n * 4
            exp["reduce_scatter"][1] += rs_calls * o_out * n * 4
            exp["all_gather"][0] += o_in * n * 4
            exp["all_gather"][1] += o_out * n * 4
        if R > 1:
            per_peer = -(-2 * n * 4 // R)
            exp["all_reduce"][0] += r_in * per_peer
            exp["all_reduce"][1] += r_out * per_peer
    return {k: v for k, v in exp.items() if v != [0, 0]}


@pytest.mark.parametrize("rpn,micro", [(2, 1), (4, 3)])
def test_ledger_and_memory_match_closed_forms(spawn, rpn, micro):
    per_rank = spawn(_ledger_and_memory, 8, rpn, micro)
    for rank, result in enumerate(per_rank):
        for name, info in result.items():
            ledger = info["ledger"]
            got = {k: [ledger[k]["intra"], ledger[k]["inter"]] for k in ("reduce_scatter", "all_reduce", "all_gather")
                   if k in ledger}
            assert got == expected_bucket_bytes(info, rpn, micro), (name, rank)
            if info["optim"] <= rpn:   # node-local optim group: weights never cross nodes
                assert "all_gather" not in ledger or ledger["all_gather"]["inter"] == 0, name
            padded = sum(info["numel"])
            formula = model_state_bytes(
                padded_numel=padded, owned_numel=info["owned"], param_bytes=4, grad_bytes=4, param_shards=1,
                optim_shards=info["optim"], full_grad_buffer=info["mode"] == "local", master_bytes=0, state_bytes=8,
                pool_bytes=2 * 4 * max(info["numel"]) if info["mode"] == "pool" else 0)
            mem = info["memory"]
            assert {k: mem[k] for k in formula} == formula and mem["gather_pool"] == 0, (name, rank)
    # Each optim group owns every real element exactly once: the optimizer states are 8 P / s_os per rank.
    for name, info in per_rank[0].items():
        o = info["optim"]
        assert sum(r[name]["owned"] for r in per_rank[:o]) == info["total"], name


def _memory_bf16_and_qwz():
    """The master copy exists where it must: bf16 parameters, or fp32 gathered by qwZ."""
    out = {}
    for label, dtype, pg in (("bf16", torch.bfloat16, "plain"), ("fp32_qwz", torch.float32, "qwz"),
                             ("fp32", torch.float32, "plain")):
        module = make_model().to(dtype)
        model = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=BUCKET, sharding=ShardingPlan.mics(2),
                                                          ranks_per_node=2, param_gather=pg))
        mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=LR, bf16=dtype == torch.bfloat16),
                                          model)
        out[label] = (model.memory_report(), sum(b.numel for b in model.buckets) // model.plan.optim,
                      sum(b.numel for b in model.buckets))
    return out


def test_master_copy_only_where_needed(spawn):
    report = spawn(_memory_bf16_and_qwz, 4)[0]
    for label, (mem, shard, padded) in report.items():
        assert mem["master_weights"] == (0 if label == "fp32" else 4 * shard), label
        assert mem["parameters"] == padded * (2 if label == "bf16" else 4), label


# -- checkpoints: saved under one plan, resumed under another -------------------------------------------------
def _resume_across_plans(first: ShardingPlan, second: ShardingPlan, rpn: int):
    rank = dist.get_rank()
    micro = 2

    def build(plan, module):
        model = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=BUCKET, sharding=plan, ranks_per_node=rpn))
        return model, mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD,
                                                                        clip_grad=CLIP), model)

    model, opt = build(first, make_model())
    for step in range(2):
        assert odo_train_step(model, opt, step, rank, micro)[0]
    local = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, local)
    canonical = merge_optimizer_shards(shards)
    resumed_module = make_model(seed=123)   # other initial weights: everything must come from the checkpoint
    resumed_module.load_state_dict(weights)
    model2, opt2 = build(second, resumed_module)
    opt2.load_state_dict(canonical)
    for step in range(2, 4):
        assert odo_train_step(model2, opt2, step, rank, micro)[0]
    model2.force_param_sync()
    return {n: p.detach().clone() for n, p in model2.module.named_parameters()}


@pytest.mark.parametrize("first,second", [
    (ShardingPlan.amsp_7b(2), ShardingPlan.zero2()),
    (ShardingPlan.zero2(), ShardingPlan.mics(2)),
    (ShardingPlan(grad=4, optim=4), ShardingPlan.zero1()),
    (ShardingPlan.zero3(hpz=2), ShardingPlan.zero2()),
    (ShardingPlan.amsp_7b(2), ShardingPlan.zero3(4, hpz=2)),
])
def test_checkpoint_saved_in_one_plan_resumes_in_another(spawn, first, second):
    per_rank = spawn(_resume_across_plans, 8, first, second, 2)
    ref, _ = reference_training(8, 2, 4, LR, WD, CLIP)
    for n, t in ref.items():
        torch.testing.assert_close(per_rank[0][n], t, rtol=1e-5, atol=1e-6, msg=n)
        assert all(torch.equal(per_rank[0][n], r[n]) for r in per_rank[1:])


# -- invalid plans: rejected before any collective, naming the flag and the rule ------------------------------
@pytest.mark.parametrize("plan,dp,rpn,words", [
    (ShardingPlan(optim=3), 8, 2, ["--optim-shard-size", "does not divide"]),
    (ShardingPlan(grad=4, optim=2), 8, 2, ["--grad-shard-size", "param <= grad <= optim"]),
    (ShardingPlan(grad=2, optim=8), 8, 2, ["--grad-shard-size", "s_g in {s_p, s_os}"]),
    (ShardingPlan(optim=6), 12, 4, ["--optim-shard-size", "aligned with nodes"]),
    (ShardingPlan(grad=2, optim=None), 8, 2, ["--grad-shard-size", "s_g in {s_p, s_os}"]),
])
def test_invalid_plans_name_flag_and_rule(plan, dp, rpn, words):
    with pytest.raises(ValueError) as e:
        plan.resolve(dp, rpn, 0)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs,words", [
    ({"param": 0}, ["--param-shard-size"]),
    ({"hpz": 2}, ["--hpz-partition-size", "--param-shard-size"]),
    ({"optim": 0}, ["--optim-shard-size"]),
    ({"grad": "some"}, ["--grad-shard-size"]),
])
def test_plan_fields_checked_at_construction(kwargs, words):
    with pytest.raises(ValueError) as e:
        ShardingPlan(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_accumulate_is_a_spelling_of_the_grad_factor():
    assert mx.OverlapConfig(accumulate="local").sharding.grad == 1
    assert mx.OverlapConfig(accumulate="shard", sharding=ShardingPlan(optim=4)).sharding.grad == 4
    assert mx.OverlapConfig(accumulate="auto").sharding.grad == "auto"
    assert mx.OverlapConfig(accumulate="local").accumulate is None
    with pytest.raises(ValueError, match="--odo-accumulate.*--grad-shard-size"):
        mx.OverlapConfig(accumulate="local", sharding=ShardingPlan(grad=4, optim=4))
    assert ShardingPlan.from_instances(2, 8) == ShardingPlan(grad=4, optim=4)
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances"):
        ShardingPlan.from_instances(3, 8)


def _only_rank0_builds_invalid():
    # Only rank 0 builds the wrapper: any collective before the check would wait for peers that never come.
    if dist.get_rank() != 0:
        return "idle"
    try:
        mx.OverlappedDDP(make_model(), mx.OverlapConfig(sharding=ShardingPlan(optim=2), ranks_per_node=3))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_invalid_plan_rejected_before_any_collective(spawn):
    msg = spawn(_only_rank0_builds_invalid, 6)[0]
    assert "--optim-shard-size" in msg and "aligned with nodes" in msg, msg


# -- quantized backends inside plans: within the derived bound of the plain run of the same plan --------------
QUANT_PLANS = {"amsp_7b": ShardingPlan.amsp_7b(2), "span_shard": ShardingPlan(grad=4, optim=4)}
QUANT_COMBOS = {"plain": ("plain", "plain", 4), "qgz4+qwz": ("qgz", "qwz", 4), "bytegrad": ("bytegrad", "plain", 4)}
Q_LR, Q_GROUP = 0.1, 32


def _rounds(combo: str, plan: str) -> int:
    """Quantization rounds a gradient goes through: qgZ's hierarchical reduce-scatter over a group spanning nodes
    with several ranks per node quantizes twice (contributions, then node sums), with one rank per node once; the
    replica all-reduce adds the quantized gather of the averaged piece; ByteGrad compresses twice per stage."""
    if combo == "plain":
        return 0
    stages = {"amsp_7b": [("replica", 1)], "span_shard": [("optim", 2), ("replica", 1)]}[plan]
    if combo.startswith("qgz"):
        return sum(r + (1 if kind == "replica" else 0) for kind, r in stages)
    return 2 * len(stages)


def _quantized_plans():
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(16, 11, generator=torch.Generator().manual_seed(10 + rank))
    y = torch.randn(16, 7, generator=torch.Generator().manual_seed(20 + rank))
    module = make_model()
    torch.nn.functional.mse_loss(module(x), y).backward()
    local_absmax = max(p.grad.abs().max().item() for p in module.parameters())
    out = {"local_absmax": local_absmax}
    for pname, plan in QUANT_PLANS.items():
        for cname, (gr, pg, bits) in QUANT_COMBOS.items():
            model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(
                bucket_size=BUCKET, sharding=plan, ranks_per_node=2, grad_reduce=gr, param_gather=pg,
                qgz_bits=bits, quant_group_size=Q_GROUP))
            opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="sgd", lr=Q_LR, weight_decay=0.0,
                                                                    clip_grad=0.0, sgd_momentum=0.0), model)
            weights = []
            for _ in range(3):
                torch.nn.functional.mse_loss(model(x), y).backward()
                model.finish_grad_sync()
                assert opt.step()[0]
                opt.zero_grad()
                model.force_param_sync()
                weights.append(torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]))
                if len(weights) == 1:
                    ledger = model.ledger.summary()
            out[(pname, cname)] = {"weights": weights, "ledger": ledger}
    return out


def test_quantized_backends_in_plans_within_derived_bounds(spawn):
    per_rank = spawn(_quantized_plans, 8)
    G = max(r["local_absmax"] for r in per_rank)
    for pname in QUANT_PLANS:
        plain = per_rank[0][(pname, "plain")]["weights"][0]
        for cname in ("qgz4+qwz", "bytegrad"):
            res = per_rank[0][(pname, cname)]
            w = res["weights"][0]
            q = 7 if cname.startswith("qgz") else 127.5
            rounds = _rounds(cname, pname)
            grad_bound = sum(G * (1 + 1 / (2 * q)) ** k / (2 * q) for k in range(rounds))
            weight_bound = max(plain.abs().max().item(), w.abs().max().item()) / 254 if "qwz" in cname else 0.0
            err = (w - plain).abs().max().item()
            assert 0 < err <= Q_LR * grad_bound + weight_bound + 1e-6, (pname, cname, err, grad_bound, weight_bound)
            for r in per_rank[1:]:   # quantized or not, every rank holds bit-identical weights
                assert all(torch.equal(a, b) for a, b in zip(res["weights"], r[(pname, cname)]["weights"]))
            ledger = res["ledger"]
            quantized_inter = sum(v["inter"] for k, v in ledger.items() if k.startswith(("qgz", "bytegrad")))
            assert quantized_inter > 0, (pname, cname, ledger)
            # The cross-node part is quantized: full-precision gradient rows never leave the node.
            for k in ("reduce_scatter", "all_reduce"):
                assert ledger.get(k, {"inter": 0})["inter"] == 0, (pname, cname, k, ledger)


def _bf16_replica_all_reduce():
    model = mx.OverlappedDDP(make_model().to(torch.bfloat16), mx.OverlapConfig(
        bucket_size=BUCKET, sharding=ShardingPlan.mics(2), ranks_per_node=2, grad_reduce_in_fp32=False))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=LR, bf16=True), model)
    x = torch.randn(4, 11, generator=torch.Generator().manual_seed(dist.get_rank())).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    model.finish_grad_sync()
    assert opt.step()[0]
    return model.ledger.summary()["all_reduce"], [b.shard_numel for b in model.buckets]


def test_replica_all_reduce_travels_in_the_reduce_scatter_dtype(spawn):
    # Without grad_reduce_in_fp32 the cross-node all-reduce carries bf16 (2 bytes), not the fp32 reduced shard.
    row, shards = spawn(_bf16_replica_all_reduce, 4)[0]
    assert row["inter"] == sum(-(-2 * n * 2 // 2) for n in shards) and row["intra"] == 0


def _all_micro_batches_in_no_sync(plan):
    """Megatron-LM's pipeline schedules (and virtual pipelining) run every backward of a stage inside no_sync()
    and then call start_grad_sync(): replicated shards must still be all-reduced across the replicas."""
    import contextlib  # noqa: F401

    from .models import batch

    rank = dist.get_rank()
    model = mx.OverlappedDDP(make_model(), mx.OverlapConfig(bucket_size=BUCKET, sharding=plan, ranks_per_node=2))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD,
                                                            clip_grad=CLIP), model)
    micro = 2
    for step in range(STEPS):
        with model.no_sync():
            for i in range(micro):
                x, y = batch(step, rank, i)
                opt.scale_loss(torch.nn.functional.mse_loss(model(x), y) / micro).backward()
        model.start_grad_sync()
        model.finish_grad_sync()
        assert opt.step()[0]
        opt.zero_grad()
    model.force_param_sync()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("plan", [ShardingPlan.mics(2), ShardingPlan(grad=2, optim=2), ShardingPlan.zero3(2)],
                         ids=["mics", "grad_eq_optim", "zero3_node"])
def test_replicas_all_reduced_when_every_backward_runs_in_no_sync(spawn, plan):
    per_rank = spawn(_all_micro_batches_in_no_sync, 4, plan)
    ref, _ = reference_training(4, 2, STEPS, LR, WD, CLIP)
    for n, t in ref.items():
        torch.testing.assert_close(per_rank[0][n], t, rtol=1e-5, atol=1e-6, msg=n)
        assert all(torch.equal(per_rank[0][n], r[n]) for r in per_rank[1:]), n
