"""The solver's promises: nothing over the memory cap is returned (and what is left out is counted), every plan it
returns is one the ODO accepts, lossy backends only when asked, sharding factors aligned to nodes (seed 004)."""
from __future__ import annotations

import pytest

from megatron_ext.optimizer.sharding import ShardingPlan
from megatron_ext.planner import ModelSpec, hardware_preset, solve
from megatron_ext.planner.cli import workload_from
from megatron_ext.planner.search import aligned_factors, candidate_plans, enumerate_candidates

# A GPT-2 small shape (~0.16B parameters): plans differ in memory, and a search takes a moment.
SPEC = ModelSpec("gpt-12x768", num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50304,
                 seq_length=1024)
BUCKETS = (10_000_000, 40_000_000)


def _wl(gpus=32, per_node=8, micro_batch=1, global_batch=32):
    return workload_from(SPEC, gpus=gpus, gpus_per_node=per_node, micro_batch=micro_batch, global_batch=global_batch)


@pytest.fixture(scope="module")
def everything():
    """Every candidate's prediction (no cap), with the lossy backends."""
    wl = _wl()
    return wl, solve(wl, hardware_preset("dgx-a100"), float("inf"), allow_quantized=True, bucket_sizes=BUCKETS)


def test_tight_cap_returns_only_what_fits_and_counts_the_rest(everything):
    wl, full = everything
    assert full.infeasible == 0
    totals = sorted(p.memory["total"] for p in full.ranked)
    assert totals[0] < totals[-1]
    cap = totals[len(totals) // 2]          # about half the candidates are over it
    r = solve(wl, hardware_preset("dgx-a100"), cap, allow_quantized=True, bucket_sizes=BUCKETS)
    assert r.ranked and all(p.memory["total"] <= cap for p in r.ranked)
    assert r.infeasible == sum(t > cap for t in totals) > 0
    assert len(r.ranked) + r.infeasible == len(full.ranked)
    assert r.best.memory["total"] <= cap
    assert [p.step_s for p in r.ranked] == sorted(p.step_s for p in r.ranked)   # fastest first


def test_every_returned_plan_resolves_on_every_rank(everything):
    wl, full = everything
    for p in full.ranked:
        c = p.candidate
        plan = ShardingPlan(param=c.param, grad=c.grad, optim=c.optim, hpz=c.hpz)
        for rank in range(wl.dp):           # the rules the ODO enforces, from every rank's point of view
            plan.resolve(wl.dp, wl.ranks_per_node, rank)


@pytest.mark.parametrize("dp, per_node", [(32, 8), (48, 8), (8, 2), (16, 4), (4, 4)])
def test_plans_are_exactly_those_the_odo_accepts(dp, per_node):
    """The pre-filter neither drops a plan the ODO runs nor admits one it refuses: brute force over every
    (param, grad, optim, hpz) of divisors of DP, checked by ``ShardingPlan.resolve`` on every rank."""
    divisors = [f for f in range(1, dp + 1) if dp % f == 0]
    accepted = set()
    for p in divisors:
        for g in divisors:
            for o in divisors:
                for h in divisors:
                    try:
                        for rank in range(dp):
                            ShardingPlan(param=p, grad=g, optim=o, hpz=h).resolve(dp, per_node, rank)
                    except ValueError:
                        continue
                    accepted.add((p, g, o, h))
    plans = candidate_plans(dp, per_node)
    assert len(plans) == len(set(plans)) and set(plans) == accepted


def test_only_backends_this_build_has(monkeypatch):
    import megatron_ext.comm as comm

    monkeypatch.setattr(comm, "available_grad_reduce", lambda: ["plain", "qgz"])
    monkeypatch.setattr(comm, "available_param_gather", lambda: ["plain"])
    cands = enumerate_candidates(_wl(), allow_quantized=True, bucket_sizes=BUCKETS[:1])
    assert {c.grad_reduce for c in cands} == {"plain", "qgz"} and {c.param_gather for c in cands} == {"plain"}


def test_cap_below_every_plan_is_a_clear_error(everything):
    wl, full = everything
    cap = min(p.memory["total"] for p in full.ranked) - 1
    r = solve(wl, hardware_preset("dgx-a100"), cap, allow_quantized=True, bucket_sizes=BUCKETS)
    assert r.ranked == [] and r.infeasible == len(full.ranked)
    with pytest.raises(ValueError, match=r"no plan fits in .* GiB per GPU \(--gpu-memory\)"):
        r.best


def test_quantized_backends_only_when_allowed(everything):
    wl, full = everything
    lossy = [p.candidate for p in full.ranked if p.candidate.lossy]
    assert {c.grad_reduce for c in lossy} == {"plain", "qgz", "bytegrad"}
    assert any(c.param_gather == "qwz" for c in lossy)
    plain = solve(wl, hardware_preset("dgx-a100"), float("inf"), bucket_sizes=BUCKETS)
    assert plain.ranked and not any(p.candidate.lossy for p in plain.ranked)
    assert {(c.grad_reduce, c.param_gather) for c in (p.candidate for p in plain.ranked)} == {("plain", "plain")}
    # on one node nothing crosses nodes: no lossy candidate even when allowed
    one_node = enumerate_candidates(_wl(gpus=8, global_batch=8), allow_quantized=True, bucket_sizes=BUCKETS)
    assert one_node and not any(c.lossy for c in one_node)


def test_factors_are_node_aligned():
    # 48 DP ranks on 6 nodes of 8: inside a node (1, 2, 4, 8) or whole nodes (16, 24, 48); never 3, 6 or 12
    assert aligned_factors(48, 8) == [1, 2, 4, 8, 16, 24, 48]
    wl = _wl(gpus=48, global_batch=48)
    cands = enumerate_candidates(wl, allow_quantized=True, bucket_sizes=BUCKETS[:1])
    assert {c.optim for c in cands} == {1, 2, 4, 8, 16, 24, 48}
    for c in cands:
        for f in (c.param, c.grad, c.optim):
            assert 48 % f == 0 and (8 % f == 0 or f % 8 == 0), c.label
        assert c.grad in (1, c.optim) and c.param in (1, c.optim), c.label
        assert 8 % c.hpz == 0 and (c.hpz == 1 or c.param > 1), c.label
