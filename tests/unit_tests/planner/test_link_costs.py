"""How the cost model charges a collective to a link: gloo's reduce-scatter is the all-reduce it runs."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.planner import LinkCost, ModelSpec, hardware_preset, parse_candidate, predict
from megatron_ext.planner.cli import workload_from

SPEC = ModelSpec("gpt-4x256", num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=128)


def _profile(**changes):
    # One rank per node and the pairwise count: every cross-node byte the ledger counts is one on the wire.
    return dataclasses.replace(hardware_preset("dgx-a100"), algorithm="pairwise", **changes)


def test_gloo_reduce_scatter_sends_an_all_reduce_and_takes_its_time():
    wl = workload_from(SPEC, gpus=4, gpus_per_node=1, micro_batch=1, global_batch=4)
    zero2 = parse_candidate("p1.g4.o4.h1 plain+plain b250k")   # per bucket: one reduce-scatter, one all-gather
    inter = dict(hardware_preset("dgx-a100").links["inter"])
    # an all-reduce on twice the bandwidth of the reduce-scatter, no latency: twice the bytes take the same time
    inter["reduce_scatter"] = LinkCost(0.0, 1e9)
    inter["all_reduce"] = LinkCost(0.0, 2e9)
    links = {"intra": hardware_preset("dgx-a100").links["intra"], "inter": inter}
    nccl = predict(zero2, wl, _profile(links=links))
    gloo = predict(zero2, wl, _profile(links=links, reduce_scatter_as_all_reduce=True))

    assert gloo.inter_bytes_per_node == nccl.inter_bytes_per_node == nccl.wire_bytes_per_node  # the ledger's count
    w = wl.wire()
    reduce_scatter_share = nccl.wire_bytes_per_node * w.grad_bytes / (w.grad_bytes + w.param_bytes)
    assert gloo.wire_bytes_per_node == pytest.approx(nccl.wire_bytes_per_node + reduce_scatter_share, rel=1e-9)
    assert gloo.step_s == pytest.approx(nccl.step_s, rel=1e-12)

    # ... and it is the all-reduce's cost that is charged: a slower all-reduce makes the gloo step slower only
    inter["all_reduce"] = LinkCost(0.0, 1e8)
    slow = {"intra": links["intra"], "inter": inter}
    assert predict(zero2, wl, _profile(links=slow)).step_s == pytest.approx(nccl.step_s, rel=1e-12)
    assert predict(zero2, wl, _profile(links=slow, reduce_scatter_as_all_reduce=True)).step_s > 1.5 * nccl.step_s


def test_int4_requantizing_reduction_has_its_own_rate():
    """qgZ's intra-node INT4 dequantize-reduce-requantize (native C on CPU) is charged at the profile's requant rate;
    INT8's requantizing step and the final dequantize-reduce stay at the reduce rate; without a requant rate the
    INT4 step falls back to the reduce rate (profiles calibrated before the split predict what they did)."""
    wl = workload_from(SPEC, gpus=8, gpus_per_node=4, micro_batch=1, global_batch=8)
    int4, int8 = (parse_candidate(f"p1.g8.o8.h1 {b}+plain b250k") for b in ("qgz4", "qgz8"))
    slow = dict(kernels_on_compute=True, kernel_bytes_per_s=1e15, reduce_kernel_bytes_per_s=1e8)
    base4, base8 = predict(int4, wl, _profile(**slow)), predict(int8, wl, _profile(**slow))
    fast4 = predict(int4, wl, _profile(requant_kernel_bytes_per_s=1e15, **slow))
    fast8 = predict(int8, wl, _profile(requant_kernel_bytes_per_s=1e15, **slow))
    assert fast8.step_s == pytest.approx(base8.step_s, rel=1e-12)   # INT8: no requant elements
    assert fast4.step_s < base4.step_s
    # the INT4 step reads each bucket's B elements once: the saving is at most 4 bytes x all buckets' elements / the
    # reduce rate, and those are the parameters plus padding to 8 shards of whole 2048-element groups (< 7% at 250k)
    assert base4.step_s - fast4.step_s <= 4.0 * SPEC.num_params * 1.07 / 1e8
    same = predict(int4, wl, _profile(requant_kernel_bytes_per_s=1e8, **slow))
    assert same.step_s == pytest.approx(base4.step_s, rel=1e-12)


@pytest.mark.parametrize("label", ["p1.g1.o8.h1 qgz4+qwz b250k", "p8.g8.o8.h2 plain+plain b1M"])
def test_each_hop_takes_its_processor_time_from_compute(label):
    """A CPU profile's ``hop_cpu_s`` is charged once per hop to the compute timeline: on links too fast to matter
    the step grows by exactly (hops per step) x ``hop_cpu_s``; a profile without it predicts as before."""
    wl = workload_from(SPEC, gpus=8, gpus_per_node=2, micro_batch=1, global_batch=16)
    fast = LinkCost(0.0, 1e18)
    links = {l: {op: fast for op in ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")}
             for l in ("intra", "inter")}
    cand = parse_candidate(label)
    base = predict(cand, wl, _profile(links=links))
    hop = 1e-3
    charged = predict(cand, wl, _profile(links=links, hop_cpu_s=hop))
    assert base.collectives > 10
    assert charged.step_s - base.step_s == pytest.approx(base.collectives * hop, rel=1e-9)
    assert predict(cand, wl, _profile(links=links, hop_cpu_s=0.0)).step_s == base.step_s


def test_ranks_sharing_processors_pool_the_bytegrad_leaders_work():
    """ByteGrad's leader quantizes and scatters, the other ranks of its node do not. On GPUs the leader's work is
    the hop's (the others wait for it); ranks sharing a node's processors (CPU) pool it, so each is charged the
    node's mean -- closed form on a 2 x 2 cluster: half the leader's kernel elements and half its intra bytes. The
    reduce-scatter has three hops: the non-leader sends the bucket (reduce), the leader compresses the bucket and
    decompresses its block's N versions (2B elements), and scatters one shard (n = B/4) to its peer."""
    from megatron_ext.planner.cost import _time_calls
    from megatron_ext.planner.memory import bucket_shapes

    wl = workload_from(SPEC, gpus=4, gpus_per_node=2, micro_batch=1, global_batch=4)
    cand = parse_candidate("p1.g4.o4.h1 bytegrad+plain b250k")
    plan = cand.sharding_plan().resolve(wl.dp, wl.ranks_per_node, 0)
    buckets, _ = bucket_shapes(SPEC.busiest_stage_numels(), cand, plan, wl.setup)
    free_alpha = {op: LinkCost(0.0, 1e9) for op in ("reduce_scatter", "all_gather", "all_reduce", "all_to_all",
                                                    "broadcast")}
    e, bps = wl.wire().grad_bytes, 1e9
    for shared in (True, False):
        prof = _profile(kernels_on_compute=shared, intra_on_compute=shared, kernel_bytes_per_s=bps,
                        links={"intra": free_alpha, "inter": free_alpha})
        timed = _time_calls(cand, wl, prof, buckets)[0]
        share = 0.5 if shared else 1.0
        seen = set()
        for t in timed:
            B = buckets[t.call.bucket].numel
            sent = {"bytegrad_intra_reduce": B * e, "bytegrad_intra_scatter": B // 4 * e}
            if t.call.name == "bytegrad_inter_all_to_all":
                assert t.kernel_s == pytest.approx(4.0 * share * 2 * B / bps, rel=1e-12)
            if t.call.name in sent:
                # one of the two ranks sends in each; the link itself carries it either way
                assert t.intra_s == pytest.approx(share * sent[t.call.name] / 1e9, rel=1e-12)
                assert t.duration == pytest.approx(sent[t.call.name] / 1e9, rel=1e-12)
            seen.add(t.call.name)
        assert {n for n in seen if n.startswith("bytegrad")} == {"bytegrad_inter_all_to_all", "bytegrad_intra_reduce",
                                                                "bytegrad_intra_scatter"}


def test_ring_sends_what_nccl_reduce_scatter_sends_and_is_searched_on_gloo_only():
    """The ring reduce-scatter (comm/ring.py) moves NCCL's ring bytes, half of what gloo's reduce-scatter (an
    all-reduce) moves; on a slow link its step is the faster one, and the solver offers it only where the profile's
    reduce-scatter is an all-reduce."""
    from megatron_ext.planner import solve
    from megatron_ext.planner.search import enumerate_candidates

    wl = workload_from(SPEC, gpus=4, gpus_per_node=2, micro_batch=1, global_batch=4)
    plain, ring = (parse_candidate(f"p1.g4.o4.h1 {b}+plain b250k") for b in ("plain", "ring"))
    inter = {op: LinkCost(1e-5, 2.5e7) for op in hardware_preset("dgx-a100").links["inter"]}   # 200 Mbit/s
    links = {"intra": hardware_preset("dgx-a100").links["intra"], "inter": inter}
    nccl = dataclasses.replace(hardware_preset("dgx-a100"), links=links)
    gloo = dataclasses.replace(nccl, reduce_scatter_as_all_reduce=True)
    p_nccl, p_gloo, r = predict(plain, wl, nccl), predict(plain, wl, gloo), predict(ring, wl, gloo)
    assert r.wire_bytes_per_node == p_nccl.wire_bytes_per_node < p_gloo.wire_bytes_per_node
    w = wl.wire()
    rs_nccl = p_nccl.wire_bytes_per_node * w.grad_bytes / (w.grad_bytes + w.param_bytes)
    assert p_gloo.wire_bytes_per_node - r.wire_bytes_per_node == pytest.approx(rs_nccl, rel=1e-9)
    assert r.step_s < p_gloo.step_s
    assert r.collectives == 2 * p_gloo.collectives   # per bucket: 3 ring hops + the gather against 1 + 1
    found = {c.grad_reduce for c in enumerate_candidates(wl, bucket_sizes=(250_000,), ring=True)}
    assert found == {"plain", "ring"}
    assert {p.candidate.grad_reduce for p in solve(wl, nccl, bucket_sizes=(250_000,)).ranked} == {"plain"}
    assert "ring" in {p.candidate.grad_reduce for p in solve(wl, gloo, bucket_sizes=(250_000,)).ranked}


def test_ring_replica_all_reduce_aligns_shards_to_the_replica_count():
    """The ring's replica all-reduce is GradReduce's default (a piece per replica): with 3 replicas the ODO aligns
    shards to lcm(64, 3), and so must the planner, or its buckets drift from the ledger."""
    from megatron_ext.planner.memory import TrainingSetup, plan_alignment

    cand = parse_candidate("p1.g2.o2.h1 ring+plain b250k")
    plan = cand.sharding_plan().resolve(6, 2, 0)   # optim inside a node, 3 replicas across nodes
    assert plan_alignment(cand, plan, TrainingSetup()) == 192
    assert plan_alignment(parse_candidate("p1.g2.o2.h1 plain+plain b250k"), plan, TrainingSetup()) == 64
