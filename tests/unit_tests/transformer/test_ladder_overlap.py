"""Ladder communication schedule, observed at the communication library: forward reductions waited one module
later (Algorithm 1), backward reductions overlapped, and no per-module blocking all-reduce in backward."""
from __future__ import annotations

import pytest

from unit_tests.dist_harness import run_distributed
from unit_tests.test_utilities import Utils
from unit_tests.transformer.comm_recorder import hook_modules, record_all_reduces

L, H, S, B = 3, 32, 8, 2
SHAPE = dict(num_layers=L, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=S)


def _schedules():
    """One TP=2 world: forward event trace and backward all-reduces of a ladder and a desync-2x model."""
    from megatron_ext.models import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.transformer import comm

    Utils.initialize_model_parallel(2, 1)
    out = {}
    try:
        b = synthetic_gpt_batch(B, S, SHAPE["vocab_size"])
        for name, kw in (("ladder", dict(ladder_residual=True)), ("desync2x", dict(desync_residual="2x"))):
            model = build_gpt_model(**SHAPE, **kw)
            fwd, bwd = [], []
            hook_modules([m for layer in model.decoder.layers for m in (layer.self_attention, layer.mlp)], fwd)
            with record_all_reduces(fwd):
                loss = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).mean()
            comm.TRACE = []
            with record_all_reduces(bwd):
                loss.backward()
            out[name] = dict(forward=fwd, backward=[e for e in bwd if e[0] == "launch"], grad_trace=comm.TRACE)
            comm.TRACE = None
        return out
    finally:
        comm.TRACE = None
        Utils.destroy_model_parallel()


@pytest.fixture(scope="module")
def schedules():
    return run_distributed(_schedules, 2)[0]


def test_forward_reduction_of_module_m_is_waited_after_module_m_plus_1(schedules):
    """Algorithm 1: launch(m) < compute(m+1) < wait(m) < compute(m+2). Waiting at once fails this."""
    trace = schedules["ladder"]["forward"]
    pos = {e[:2]: i for i, e in enumerate(trace) if e[0] in ("pre", "post")}
    modules = 2 * L
    for m in range(modules):
        end = pos.get(("pre", m + 1), len(trace))
        launches = [e for e in trace[pos[("post", m)]:end] if e[0] == "launch"]  # last: + loss all-reduces
        assert launches and launches[0][3], f"module {m}: expected an async all-reduce, got {launches}"
        assert m + 1 == modules or len(launches) == 1, f"module {m}: {launches}"
        wait = trace.index(("wait", launches[0][1]))
        if m + 1 < modules:
            assert wait > pos[("post", m + 1)], f"module {m}'s reduction waited before module {m + 1} ran: {trace}"
        if m + 2 < modules:
            assert wait < pos[("pre", m + 2)], f"module {m + 2} ran before module {m}'s reduction was waited"


def test_backward_reduction_of_module_k_overlaps_module_k_plus_1(schedules):
    trace = schedules["ladder"]["grad_trace"]
    pos = {ev: i for i, ev in enumerate(trace)}
    modules = 2 * L
    for k in range(modules):
        assert pos[("grad_launch", k)] < pos[("grad_wait", k)] < pos[("module_backward", k)]
        if k + 1 < modules:
            # module k+1's backward runs while module k's output-gradient all-reduce is in flight
            assert pos[("grad_launch", k)] < pos[("module_backward", k + 1)] < pos[("grad_wait", k)], trace


def _numbered(calls):
    """``[(numel, async_op), ...]`` -> the recorder's ``("launch", i, numel, async_op)`` list."""
    return [("launch", i, n, a) for i, (n, a) in enumerate(calls)]


def test_backward_has_no_per_module_blocking_all_reduce(schedules):
    """Closed form at TP=2 (numels, in order): the output layer's async input-grad all-reduce (S*B*H); per module
    what the wiring needs; per layer ONE blocking all-reduce of its partial parameter gradients (norm
    weight+bias: 4H; desync also the two row-parallel biases: 2H), issued right after that layer's backward; the
    first layer's also carries the block-input gradient (S*B*H)."""
    act = S * B * H
    # Ladder, backward from the top: the flush adds launch the reductions of modules 2L-1 and 2L-2; then per layer
    # i the add before module 2i+1 launches module 2i-1's, layer i's parameter sum runs once module 2i's backward
    # is done, and only then does the add before module 2i launch module 2i-2's -- so that reduction overlaps
    # module 2i-1's backward instead of being waited for by a blocking all-reduce queued behind it.
    calls = [(act, True)] * 3
    for _ in range(L - 1, 0, -1):
        calls += [(act, True), (4 * H, False), (act, True)]
    calls += [(act + 4 * H, False)]
    assert schedules["ladder"]["backward"] == _numbered(calls)
    # Desync-2x: each layer's MLP reduces, in forward and backward alike; then that layer's parameter sum.
    calls = [(act, True)] + [(act, False), (6 * H, False)] * (L - 1) + [(act, False), (act + 6 * H, False)]
    assert schedules["desync2x"]["backward"] == _numbered(calls)


def _sequence_parallel_rejected():
    from megatron_ext.models import build_gpt_model

    Utils.initialize_model_parallel(2, 1)
    try:
        with pytest.raises(ValueError, match="sequence-parallel"):
            build_gpt_model(**SHAPE, ladder_residual=True, sequence_parallel=True)
        with pytest.raises(ValueError, match="distribute-saved-activations"):
            build_gpt_model(**SHAPE, desync_residual="4x", recompute_granularity="full", recompute_method="block",
                            recompute_num_layers=1, distribute_saved_activations=True)
        return True
    finally:
        Utils.destroy_model_parallel()


def test_unsupported_parallel_options_are_rejected_clearly(spawn):
    assert spawn(_sequence_parallel_rejected, 2) == [True, True]


def test_flag_validation():
    from megatron_ext.transformer import LadderConfig

    with pytest.raises(ValueError, match="2x or 4x"):
        LadderConfig(desync="3x")
    with pytest.raises(ValueError, match="pick one"):
        LadderConfig(ladder=True, desync="2x")
    with pytest.raises(ValueError, match="needs --ladder-residual"):
        LadderConfig(ladder_layers=2)
    with pytest.raises(ValueError, match="exceeds"):
        LadderConfig(ladder=True, ladder_layers=5).num_ladder_layers(4)
    assert [LadderConfig(desync="4x").reduces(m) for m in range(8)] == [False, False, False, True] * 2
    assert [LadderConfig(desync="2x").reduces(m) for m in range(4)] == [False, True, False, True]
