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
