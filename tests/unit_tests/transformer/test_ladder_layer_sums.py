"""Each ladder/desync layer sums its own partial parameter gradients (norm weights, desync row-parallel biases)
over TP: the parameters are read when that layer runs and their gradients are ready right after that layer's
backward. With the overlapped optimizer this is what keeps its parameter all-gathers overlapping the forward (a
read waits for the parameter's bucket) and its gradient buckets launching during backward (a bucket launches
once all its gradients are ready, in order). Observed at TP=2 the way that optimizer observes the model: reads
through the modules' ``_parameters`` mapping, readiness through post-accumulate-grad hooks."""
from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from unit_tests.dist_harness import run_distributed
from unit_tests.test_utilities import Utils
from unit_tests.transformer.comm_recorder import Event, hook_modules

L = 4
SHAPE = dict(num_layers=L, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=8)
VARIANTS = {
    "ladder": dict(ladder_residual=True),
    # chunks of two layers: the sums of both layers of a chunk run inside its recomputation's backward
    "ladder_recompute": dict(ladder_residual=True, recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=2),
    "desync2x": dict(desync_residual="2x"),
}


class _ReadSpy(dict):
    """A module's ``_parameters`` that logs every read by attribute (``norm.weight``), as ODO's read guard sees
    it; iteration (``parameters()``) is not a read."""

    def __getitem__(self, name: str):
        self.log.append(("read", self.layer, name))
        return dict.__getitem__(self, name)


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def _summed_by_layer(name: str, desync: bool) -> bool:
    """Parameters with per-rank partial gradients, which the layer's own node sums over TP."""
    return "layernorm" in name or (desync and name.endswith(("linear_proj.bias", "linear_fc2.bias")))


def _observe():
    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch

    Utils.initialize_model_parallel(2, 1)
    out = {}
    try:
        b = synthetic_gpt_batch(2, SHAPE["seq_length"], SHAPE["vocab_size"], seed=3)
        for variant, kw in VARIANTS.items():
            model = build_gpt_model(**SHAPE, **kw)
            model.train()
            layers = model.decoder.layers
            # Replaced after the build: the parameter there when the layer runs is the one whose gradient is summed.
            old = layers[1].input_layernorm.weight
            layers[1].input_layernorm.weight = torch.nn.Parameter(old.detach().clone())
            forward: List[Event] = []
            handles = hook_modules([m for layer in layers for m in (layer.self_attention, layer.mlp)], forward)
            norms = [(k, norm) for k, layer in enumerate(layers)
                     for norm in (layer.input_layernorm, layer.pre_mlp_layernorm)]
            for k, norm in norms:
                spy = _ReadSpy(norm._parameters)
                spy.log, spy.layer = forward, k
                norm._parameters = spy
            loss = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean()
            for _, norm in norms:
                norm._parameters = dict(norm._parameters)
            for h in handles:
                h.remove()
            ready: List[str] = []
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda _, name=name: ready.append(name))
            loss.backward()
            out[variant] = dict(forward=forward, ready=ready, names=[n for n, _ in model.named_parameters()],
                                replaced_grad=layers[1].input_layernorm.weight.grad)
        return out
    finally:
        Utils.destroy_model_parallel()


@pytest.fixture(scope="module")
def observed():
    return run_distributed(_observe, 2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_layers_summed_grads_are_ready_before_any_grad_of_the_layer_below(observed, variant):
    """(Backward) A single sum at the block entry would make every norm gradient wait for the whole block."""
    desync = "desync" in variant
    for rank in observed:
        ready, names = rank[variant]["ready"], rank[variant]["names"]
        assert sorted(ready) == sorted(names), "every parameter's gradient is accumulated exactly once"
        pos = {n: i for i, n in enumerate(ready)}
        for k in range(1, L):
            summed = [n for n in names if _layer_of(n) == k and _summed_by_layer(n, desync)]
            below = [n for n in names if _layer_of(n) == k - 1]
            assert len(summed) == (6 if desync else 4) and below
            late = [n for n in summed if pos[n] > min(pos[b] for b in below)]
            assert not late, f"{variant}: {late} ready only after layer {k - 1}'s backward began: {ready}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_layers_norm_weights_are_read_only_once_the_layer_below_has_run(observed, variant):
    """(Forward) Reading every norm weight at the block entry would wait for all their all-gathers at once."""
    for rank in observed:
        trace = rank[variant]["forward"]
        for k in range(1, L):
            reads = [i for i, e in enumerate(trace) if e[0] == "read" and e[1] == k]
            done_below = trace.index(("post", 2 * k - 1))  # layer k-1's MLP has returned
            assert reads and min(reads) > done_below, f"{variant}: layer {k}'s norms read early: {trace}"


def test_a_parameter_replaced_after_the_build_gets_the_summed_gradient(observed):
    for variant in VARIANTS:
        grads = [rank[variant]["replaced_grad"] for rank in observed]
        assert grads[0] is not None and grads[0].abs().max() > 0, variant
        # TP ranks hold different partial gradients of a norm weight; only their sum is the same on both
        assert torch.equal(grads[0], grads[1]), variant
