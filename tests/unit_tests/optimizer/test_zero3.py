"""ZeRO-3 (parameter sharding) and hpZ: equivalence with single-process training, the ledger's closed form (seed 000
Table 1), hpZ invalidation, the memory formula and the bound on live full-weight buffers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig

import megatron_ext as mx
from megatron_ext import ShardingPlan
from megatron_ext.optimizer.memory import model_state_bytes

from .models import make_tied, odo_tied_step, param_groups, reference_tied, tied_loss, token_batch

STEPS, LR, WD, CLIP, BUCKET, POOL = 3, 1e-2, 0.1, 0.5, 200, 6   # 9 buckets; a call chain needs 5 at once


def _wrap(plan, rpn, recompute=False, optimizer="adam", dtype=torch.float32, **kw):
    model = mx.OverlappedDDP(make_tied(recompute=recompute).to(dtype), mx.OverlapConfig(
        bucket_size=BUCKET, sharding=plan, ranks_per_node=rpn, gather_pool_size=POOL, **kw))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(
        optimizer=optimizer, lr=LR, weight_decay=WD, clip_grad=CLIP, sgd_momentum=0.9,
        bf16=dtype == torch.bfloat16), model)
    return model, opt


def _weights(model):
    model.force_param_sync()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _train_cases(cases, optimizer):
    rank = dist.get_rank()
    out = {}
    for rpn, hpz, micro, recompute in cases:
        model, opt = _wrap(ShardingPlan.zero3(hpz=hpz), rpn, recompute, optimizer)
        peaks = []
        for step in range(STEPS):
            assert odo_tied_step(model, opt, step, rank, micro)[0]
            peaks.append(model.param_buffer.peak_live())
        out[(rpn, hpz, micro, recompute)] = (_weights(model), peaks, model.param_buffer.overflows(),
                                             model.param_sync.learning)
    return out


def _check(per_rank, dp, cases, optimizer):
    for case in cases:
        ref = reference_tied(dp, case[2], STEPS, LR, WD, CLIP, optimizer)
        params0, peaks, _, learning = per_rank[0][case]
        assert not learning
        for r in range(1, dp):
            for n in params0:
                assert torch.equal(params0[n], per_rank[r][case][0][n]), (case, r, n)
        for n, t in ref.items():   # the same bound and reason as test_equivalence (fp32 sums in another order)
            torch.testing.assert_close(params0[n], t, rtol=1e-5, atol=1e-6, msg=f"{case} {n}")
        # After the first (recording) step, full weights never exceed the gather pool in forward and backward.
        assert max(peaks[1:]) <= POOL, (case, peaks)


CASES_DP4 = [(2, 1, 1, False), (2, 2, 3, False), (4, 4, 1, True), (2, 2, 1, True)]
CASES_DP8 = [(2, 2, 3, False), (4, 4, 1, False), (8, 8, 3, True), (4, 1, 1, True)]


def test_zero3_matches_single_process_dp4(spawn):
    _check(spawn(_train_cases, 4, CASES_DP4, "adam"), 4, CASES_DP4, "adam")


def test_zero3_matches_single_process_dp8(spawn):
    _check(spawn(_train_cases, 8, CASES_DP8, "adam"), 8, CASES_DP8, "adam")


def test_zero3_sgd_tight(spawn):
    cases = [(2, 2, 3, False), (2, 1, 1, True)]
    _check(spawn(_train_cases, 4, cases, "sgd"), 4, cases, "sgd")


# -- ledger: seed 000 Table 1 by measurement (closed form for the actual padded buckets) -----------------------
GROUP = 64


def _ledger_step(rpn, hpz, gr, pg):
    # bf16 weights and gradients on the wire, as in seed 000 (M = model bytes in bf16).
    model, opt = _wrap(ShardingPlan.zero3(hpz=hpz), rpn, grad_reduce=gr, param_gather=pg, grad_reduce_in_fp32=False,
                       quant_group_size=GROUP, dtype=torch.bfloat16)
    for step in range(2):   # the first step records the schedule; the second is the steady state
        model.ledger.reset()
        assert odo_tied_step(model, opt, step, dist.get_rank(), 1)[0]
    return {"ledger": model.ledger.summary(), "shards": [b.shard_numel for b in model.buckets],
            "numel": [b.numel for b in model.buckets]}


def _ledger_all(rpn):
    return {label: _ledger_step(rpn, *cfg) for label, cfg in LEDGER_CASES.items()}


LEDGER_CASES = {"zero3": (1, "plain", "plain"), "zero3+hpz": (2, "plain", "plain"),
                "zero++": (2, "qgz", "qwz")}


def expected_zero3(info, P, D, hpz, gr, pg, e=2):
    """Bytes one rank sends per step: a forward gather from the primary shards (plain: n*e to each peer; qwZ: its
    row), a backward gather (again from the primary, or from the hpZ pieces inside the node), one reduce-scatter."""
    from megatron_ext.comm.qgz import qgz_bytes
    from megatron_ext.comm.qwz import qwz_row_bytes

    exp = {}

    def add(name, intra, inter):
        row = exp.setdefault(name, [0, 0])
        row[0] += intra
        row[1] += inter

    for n, numel in zip(info["shards"], info["numel"]):
        per_peer = qwz_row_bytes(n, GROUP) if pg == "qwz" else n * e
        fwd = "qwz_all_gather" if pg == "qwz" else "all_gather"
        add(fwd, (D - 1) * per_peer, (P - D) * per_peer)
        if hpz > 1:
            add("hpz_all_gather", (hpz - 1) * numel // hpz * e, 0)
        else:
            add(fwd, (D - 1) * per_peer, (P - D) * per_peer)
        if gr == "qgz":
            intra, inter = qgz_bytes(n, P // D, D, 4, 2, GROUP)
            add("qgz_intra_all_to_all", intra, 0)
            add("qgz_inter_all_to_all", 0, inter)
        else:
            add("reduce_scatter", (D - 1) * n * e, (P - D) * n * e)
    return exp


def test_zero3_ledger_matches_seed_000_table_1(spawn):
    P, D = 8, 4
    per_rank = spawn(_ledger_all, P, D)
    for rank, result in enumerate(per_rank):
        for label, (hpz, gr, pg) in LEDGER_CASES.items():
            info = result[label]
            got = {k: [v["intra"], v["inter"]] for k, v in info["ledger"].items()
                   if k not in ("total", "dp_scalar_all_reduce")}
            assert got == expected_zero3(info, P, D, hpz, gr, pg), (label, rank)
    # hpZ: the backward gathers never cross nodes.
    assert all(r["zero3+hpz"]["ledger"]["hpz_all_gather"]["inter"] == 0 for r in per_rank)
    # Cross-node bytes per step: ZeRO-3 moves 3 model copies' worth, ZeRO++ about a quarter of that (seed 000:
    # 3M -> 0.75M in ring units; the ledger's pairwise units give (0.5 + 1/(4D)) / 3 plus scales).
    inter = {label: sum(r[label]["ledger"]["total"]["inter"] - r[label]["ledger"]["dp_scalar_all_reduce"]["inter"]
                        for r in per_rank) for label in LEDGER_CASES}
    M = sum(per_rank[0]["zero3"]["numel"]) * 2
    assert inter["zero3"] == 3 * (P - D) * M   # every rank sends (P-D)/P of 3 model copies: 3 D (N-1)/N M per node
    ratio = inter["zero++"] / inter["zero3"]
    assert (0.5 + 1 / (4 * D)) / 3 <= ratio <= 1.15 * (0.5 + 1 / (4 * D)) / 3, ratio


# -- hpZ invalidation: a state-dict load mid-run, then steps, equal a run without hpZ -------------------------
def _load_mid_run(hpz):
    from megatron_ext.optimizer.checkpoint import merge_optimizer_shards

    rank = dist.get_rank()
    # Another run's state (other initial weights and data) to load in the middle of this one.
    other, other_opt = _wrap(ShardingPlan.zero2(), 2)
    other.module.load_state_dict(make_tied(seed=9).state_dict())
    other_opt.reload_model_params()
    for step in range(2):
        assert odo_tied_step(other, other_opt, 10 + step, rank, 1)[0]
    weights = other.state_dict()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, other_opt.state_dict())
    canonical = merge_optimizer_shards(shards)

    model, opt = _wrap(ShardingPlan.zero3(hpz=hpz), 2)
    for step in range(2):
        assert odo_tied_step(model, opt, step, rank, 1)[0]
    model.load_state_dict(weights)
    opt.load_state_dict(canonical)
    for step in range(2, 4):
        assert odo_tied_step(model, opt, step, rank, 2)[0]
    return _weights(model)


def test_hpz_secondary_rebuilt_after_load_and_step(spawn):
    with_hpz = spawn(_load_mid_run, 4, 2)[0]
    without = spawn(_load_mid_run, 4, 1)[0]
    for n in without:   # the secondary pieces are exact copies: the same bits as gathering from the primary
        assert torch.equal(with_hpz[n], without[n]), n


# -- memory: the formula for ZeRO-3 and ZeRO-3 + hpZ -----------------------------------------------------------
def _memory(hpz, dtype):
    model, opt = _wrap(ShardingPlan.zero3(hpz=hpz), 2, dtype=dtype)
    for step in range(2):
        odo_tied_step(model, opt, step, dist.get_rank(), 1)
    return {"memory": model.memory_report(), "numel": [b.numel for b in model.buckets],
            "owned": sum(pc.end - pc.start for pc in opt.pieces), "param": model.plan.param,
            "pool": model.buffer_pool_size}


@pytest.mark.parametrize("hpz,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_zero3_memory_matches_formula(spawn, hpz, dtype):
    per_rank = spawn(_memory, 4, hpz, dtype)
    e = torch.empty((), dtype=dtype).element_size()
    for info in per_rank:
        padded = sum(info["numel"])
        formula = model_state_bytes(
            padded_numel=padded, owned_numel=info["owned"], param_bytes=e, grad_bytes=4, param_shards=info["param"],
            optim_shards=info["param"], full_grad_buffer=False, master_bytes=0 if dtype == torch.float32 else 4,
            state_bytes=8, pool_bytes=info["pool"] * 4 * max(info["numel"]), hpz=hpz)
        mem = info["memory"]
        assert {k: mem[k] for k in formula} == formula
        # Full weights are not resident between steps: only what the next forward prefetched.
        assert mem["gather_pool"] <= POOL * max(info["numel"]) * e


def _direct_module_access():
    model, opt = _wrap(ShardingPlan.zero3(hpz=2), 2)
    assert odo_tied_step(model, opt, 0, dist.get_rank(), 1)[0]
    try:
        model.module.state_dict()     # released buckets: a clear error, and no collective (rank 0 may be alone)
        direct = "no error"
    except RuntimeError as e:
        direct = str(e)
    target = make_tied(seed=4).state_dict()
    model.module.load_state_dict(target)   # the inner module directly, as checkpoint loaders do
    assert odo_tied_step(model, opt, 1, dist.get_rank(), 1)[0] or True
    model2, _ = _wrap(ShardingPlan.zero3(hpz=2), 2)
    model2.module.load_state_dict(target)
    return direct, {k: v.clone() for k, v in model2.state_dict().items()}, target


def test_direct_module_state_dict_and_load(spawn):
    direct, loaded, target = spawn(_direct_module_access, 4)[0]
    assert "force_param_sync()" in direct, direct
    for k, v in target.items():
        assert torch.equal(loaded[k], v), k


# -- qwZ and qgZ under ZeRO-3 + hpZ, within their derived bounds -------------------------------------------------
def _fixed_gradient_runs():
    """A linear model whose gradient does not depend on its weights (d/dW sum(c * (Wx + b)) = c^T x): qwZ changes
    only the weights the model computes with, never the gradients, so the fp32 masters isolate qgZ's error and the
    model weights qwZ's."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(300 + rank)
    x, c = torch.randn(8, 13, generator=g), torch.randn(8, 37, generator=g)
    torch.manual_seed(0)
    local = torch.nn.Linear(13, 37)
    (local(x) * c).sum().backward()
    out = {"local_absmax": max(p.grad.abs().max().item() for p in local.parameters())}
    for label, (gr, pg) in {"plain": ("plain", "plain"), "qgz8+qwz": ("qgz", "qwz")}.items():
        torch.manual_seed(0)
        model = mx.OverlappedDDP(torch.nn.Linear(13, 37), mx.OverlapConfig(
            bucket_size=200, sharding=ShardingPlan.zero3(hpz=2), ranks_per_node=2, grad_reduce=gr, param_gather=pg,
            qgz_bits=8, quant_group_size=32))
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0,
                                                                clip_grad=0.0, sgd_momentum=0.0), model)
        for _ in range(2):
            (model(x) * c).sum().backward()
            model.finish_grad_sync()
            assert opt.step()[0]
            opt.zero_grad()
        model.force_param_sync()
        out[label] = {"masters": torch.cat([m.clone() for m in opt.masters]),
                      "weights": torch.cat([p.detach().reshape(-1).clone() for p in model.module.parameters()]),
                      "owned": [(pc.name, pc.start, pc.end) for pc in opt.pieces]}
    return out


def test_zero3_qwz_qgz_within_derived_bounds(spawn):
    per_rank = spawn(_fixed_gradient_runs, 4)
    G = max(r["local_absmax"] for r in per_rank)
    q = 127   # INT8 for both
    # qgZ over 2 nodes x 2 ranks quantizes twice (contributions, then node sums), each round within half a step of
    # its group's absmax, which grows by at most that much per round; two SGD steps of lr 0.1 add two such errors.
    grad_bound = sum(G * (1 + 1 / (2 * q)) ** k / (2 * q) for k in range(2))
    for r in per_rank:
        err = (r["qgz8+qwz"]["masters"] - r["plain"]["masters"]).abs().max().item()
        assert 0 < err <= 2 * 0.1 * grad_bound + 1e-6, (err, grad_bound)
        # Weights: every rank decodes qwZ's INT8 codes of the masters (half a step of the group absmax).
        w_err = (r["qgz8+qwz"]["weights"] - r["plain"]["weights"]).abs().max().item()
        w_max = max(r["plain"]["weights"].abs().max().item(), r["qgz8+qwz"]["weights"].abs().max().item())
        assert 0 < w_err <= w_max / 254 + 2 * 0.1 * grad_bound + 1e-6, w_err
    for r in per_rank[1:]:
        assert torch.equal(r["qgz8+qwz"]["weights"], per_rank[0]["qgz8+qwz"]["weights"])


def _retained_graph_backward_twice():
    """Each step runs backward twice through one retained graph (gradients add up, as in one process)."""
    rank = dist.get_rank()
    out = {}
    for hpz in (1, 2):
        model, opt = _wrap(ShardingPlan.zero3(hpz=hpz), 2, optimizer="sgd")
        for step in range(2):
            tokens, targets = token_batch(step, rank, 0)
            loss = tied_loss(model, tokens, targets)
            loss.backward(retain_graph=True)   # releases every bucket at its end
            loss.backward()                    # must gather them again
            model.finish_grad_sync()
            assert opt.step()[0]
            opt.zero_grad()
        out[hpz] = _weights(model)
    return out


def test_second_backward_through_a_retained_graph_gathers_again(spawn):
    ref = make_tied()
    opt = torch.optim.SGD(param_groups(ref, WD), lr=LR, momentum=0.9)
    for step in range(2):
        toks, tgts = zip(*[token_batch(step, r, 0) for r in range(2)])
        loss = tied_loss(ref, torch.cat(toks), torch.cat(tgts))
        loss.backward(retain_graph=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    per_rank = spawn(_retained_graph_backward_twice, 2)
    for hpz in (1, 2):
        for n, p in ref.named_parameters():   # the bound and reason of test_equivalence
            torch.testing.assert_close(per_rank[0][hpz][n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"hpz={hpz} {n}")
            assert torch.equal(per_rank[0][hpz][n], per_rank[1][hpz][n]), (hpz, n)
