"""megatron-core GPTModel on CPU/gloo through the compat shims: TP and PP give the single-process losses."""
from __future__ import annotations


import pytest
import torch

from unit_tests.test_utilities import Utils

SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)
MBS, MICRO, STEPS = 2, 2, 3


def _compat_idempotent():
    from megatron_ext.compat import cpu_compat_enabled, enable_cpu_compat
    from megatron.core.pipeline_parallel import schedules

    first = enable_cpu_compat()
    fn = schedules.forward_backward_no_pipelining
    second = enable_cpu_compat()
    assert schedules.forward_backward_no_pipelining is fn  # not wrapped twice
    t = torch.zeros(2, device=torch.cuda.current_device())
    from megatron_ext.compat import cpu_device_mode
    with cpu_device_mode():
        u = torch.ones(3, device="cuda").cuda()
    return first, second, cpu_compat_enabled(), t.device.type, u.device.type


def test_enable_cpu_compat_is_idempotent(spawn):
    (res,) = spawn(_compat_idempotent, 1)
    assert res == (True, True, True, "cpu", "cpu")


def _train(tp: int, pp: int, full_sd=None):
    """A few SGD steps through get_forward_backward_func; returns the per-step mean loss on the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.models import build_gpt_model, gpt_forward_step, synthetic_gpt_batch
    from megatron_ext.models.weights import full_parameters, load_full_state_dict

    Utils.initialize_model_parallel(tp, pp)
    try:
        model = build_gpt_model(**SHAPE)
        if full_sd is not None:
            load_full_state_dict(model, full_sd)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fb = get_forward_backward_func()
        initial = full_parameters(model) if tp == pp == 1 else None
        losses = []
        for step in range(STEPS):
            batches = iter([synthetic_gpt_batch(MBS, SHAPE["seq_length"], SHAPE["vocab_size"], seed=i)
                            for i in range(MICRO)])
            out = fb(forward_step_func=gpt_forward_step, data_iterator=batches, model=[model],
                     num_microbatches=MICRO, seq_length=SHAPE["seq_length"], micro_batch_size=MBS,
                     forward_only=False)
            opt.step()
            opt.zero_grad()
            if ps.is_pipeline_last_stage():
                losses.append(sum(float(d["lm loss"]) for d in out) / MICRO)
        return losses, initial
    finally:
        Utils.destroy_model_parallel()


@pytest.fixture(scope="module")
def reference():
    """Single-process losses and the initial weights (as built by TP=1 PP=1 with use_cpu_initialization)."""
    from unit_tests.dist_harness import run_distributed

    ((losses, weights),) = run_distributed(_train, 1, 1, 1)
    return weights, losses


def test_tp2_matches_tp1_with_cpu_initialization(spawn, reference):
    # No weight copying: use_cpu_initialization must give TP=2 the same (sliced) weights as TP=1.
    _, ref = reference
    results = spawn(_train, 2, 2, 1)
    for losses, _ in results:
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert ref[-1] < ref[0]


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pipeline_matches_single_process(spawn, reference, tp, pp):
    weights, ref = reference
    results = spawn(_train, tp * pp, tp, pp, weights)
    last = [losses for losses, _ in results if losses]
    assert len(last) == tp
    for losses in last:
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
