"""A megatron-core GPTModel trains with the ODO through megatron-core's own schedule and finalize_model_grads."""
import pytest
import torch
import torch.distributed as dist

import megatron_ext as mx

from ..test_utilities import Utils

VOCAB, SEQ, MBS, STEPS = 64, 16, 2, 3


def _train(tp: int, global_micro_batches: int, pp: int = 1, tied: bool = False, sharding=None, accumulate=None,
           report: bool = False, **model_kw):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.models.gpt import build_gpt_model, gpt_forward_step, synthetic_gpt_batch
    from megatron_ext.optimizer.megatron_config import attach_to_schedules

    Utils.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        dp = ps.get_data_parallel_world_size()
        dp_rank = ps.get_data_parallel_rank()
        gpt = build_gpt_model(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                              share_embeddings_and_output_weights=tied, **model_kw)
        ocfg = mx.OverlapConfig(bucket_size=4000, sharding=sharding or mx.ShardingPlan(), gather_pool_size=6,
                                accumulate=accumulate)
        model = mx.OverlappedDDP(gpt, ocfg, dp_group=ps.get_data_parallel_group())
        opt = mx.OverlappedDistributedOptimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0), model)
        attach_to_schedules(model, opt)
        micro = global_micro_batches // dp
        fwd_bwd = get_forward_backward_func()
        losses = []
        for step in range(STEPS):
            model.ledger.reset()
            # same data each step: the loss must fall
            batches = [synthetic_gpt_batch(MBS, SEQ, VOCAB, seed=dp_rank * micro + i) for i in range(micro)]
            out = fwd_bwd(forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=[model],
                          num_microbatches=micro, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
            ok, norm, _ = opt.step()
            assert ok
            opt.zero_grad()
            local = torch.tensor([sum(d["lm loss"].item() for d in out) / micro if out else 0.0])
            dist.all_reduce(local, group=ps.get_data_parallel_group())
            if pp > 1:  # only the last stage has the loss
                dist.all_reduce(local, group=ps.get_pipeline_model_parallel_group())
            losses.append(local.item() / dp)
        model.force_param_sync()
        tied_weight = gpt.shared_embedding_or_output_weight().detach().clone() if tied else None
        out = losses, len(model.buckets), tied_weight, model.ledger.summary()
        if report:   # the model-state memory and what it is made of
            out += ({"memory": model.memory_report(), "optim": model.plan.optim,
                     "buckets": [(b.numel, b.deferred) for b in model.buckets]},)
        return out
    finally:
        Utils.destroy_model_parallel()


def _both():
    return _train(tp=1, global_micro_batches=4), _train(tp=2, global_micro_batches=4)


def test_gpt_trains_with_odo_and_tp1_equals_tp2(spawn):
    (tp1, tp2) = spawn(_both, 2)[0]
    losses1, nb1, _, _ = tp1
    losses2, _, _, _ = tp2
    assert nb1 > 1
    assert losses1[-1] < losses1[0], losses1
    # TP=2 splits the matmuls (and sums partial products in another order): equal to fp32 rounding.
    torch.testing.assert_close(torch.tensor(losses2), torch.tensor(losses1), rtol=1e-4, atol=1e-5)


def _pp2_tied():
    losses, _, tied, ledger, report = _train(tp=1, global_micro_batches=4, pp=2, tied=True, accumulate="shard",
                                             report=True)
    return losses, tied, ledger, report


def test_pipeline_tied_embeddings_stay_identical(spawn):
    # With PP=2 the word embedding (first stage) and the output layer (last stage) are one tied weight held
    # twice; megatron-core's finalize_model_grads all-reduces ``main_grad``, which a grad-freeing optimizer
    # does not have (the Megatron-LLaMA pitfall: the copies drift apart). The ODO reduces the tied gradient
    # over the embedding group itself, so both copies receive the same update and stay bit-identical.
    from megatron_ext.planner.model_spec import ModelSpec

    per_rank = spawn(_pp2_tied, 4)   # TP=1 x PP=2 x DP=2
    losses = per_rank[0][0]
    assert losses[-1] < losses[0], losses
    first_stage = [r[1] for r in per_rank[:2]]
    last_stage = [r[1] for r in per_rank[2:]]
    for a, b in zip(first_stage, last_stage):
        assert torch.equal(a, b)
    # Ledger of one step: the tied gradient's all-reduce over the 2-rank embedding group (fp32, VOCAB x 32),
    # and the grad-norm all-reduce ([norm^2, failed], float64) over the 2-rank model-parallel group; in an
    # all-reduce of B bytes over P ranks a rank sends 2B/P to each of its P-1 peers (all on one node here).
    for _, _, ledger, _ in per_rank:
        tied_bytes = VOCAB * 32 * 4
        assert ledger["mp_grad_all_reduce"] == {"calls": 1, "intra": tied_bytes, "inter": 0, "total": tied_bytes}
        assert ledger["mp_scalar_all_reduce"] == {"calls": 1, "intra": 16, "inter": 0, "total": 16}
    # Memory ([Note: deferred buffers]): the tied bucket, reduced over the embedding group first, accumulates the
    # whole step in a buffer of its own; every other bucket reduces each micro-batch (``shard``) from the pool, so the
    # fp32 gradients are the reduced shard plus the tied bucket (a full-size buffer, ZeRO-1's gradient memory,
    # before). The planner counts the same deferred elements: the tied weight on both stages.
    spec = ModelSpec(name="test", num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                     seq_length=SEQ, untie_embeddings=False)
    assert [spec.stage_deferred_numel(1, 2, s) for s in (0, 1)] == [VOCAB * 32] * 2
    for rank, (*_, r) in enumerate(per_rank):
        padded = sum(n for n, _ in r["buckets"])
        deferred = sum(n for n, d in r["buckets"] if d)
        assert deferred == VOCAB * 32, (rank, r["buckets"])   # one bucket, already a multiple of DP
        assert r["memory"]["gradients"] == 4 * (padded // r["optim"] + deferred), (rank, r)


def _per_token_batch(seed: int):
    from megatron_ext.models.gpt import synthetic_gpt_batch
    b = synthetic_gpt_batch(MBS, SEQ, VOCAB, seed=seed)
    g = torch.Generator().manual_seed(seed + 99)
    b["loss_mask"] = (torch.rand(MBS, SEQ, generator=g) > 0.4).float()   # a different token count per batch
    return b


def _token_loss_sum(model, b):
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return (out.float().reshape(-1) * b["loss_mask"].reshape(-1)).sum()


def _per_token_forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(output_tensor):
        mask = b["loss_mask"].reshape(-1)
        loss_sum = (output_tensor.float().reshape(-1) * mask).sum()
        return loss_sum, mask.sum().to(torch.int), {"lm loss": loss_sum.detach()}
    return out, loss_func


def _per_token_grads():
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.models.gpt import build_gpt_model
    from megatron_ext.optimizer.megatron_config import attach_to_schedules

    Utils.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        dp, dp_rank, micro = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), 2
        kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ)
        gpt = build_gpt_model(**kw, calculate_per_token_loss=True)
        model = mx.OverlappedDDP(gpt, mx.OverlapConfig(bucket_size=4000), dp_group=ps.get_data_parallel_group())
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2), model)
        attach_to_schedules(model, opt)
        mine = [_per_token_batch(dp_rank * micro + i) for i in range(micro)]
        get_forward_backward_func()(forward_step_func=_per_token_forward_step, data_iterator=iter(mine),
                                    model=[model], num_microbatches=micro, seq_length=SEQ, micro_batch_size=MBS,
                                    forward_only=False)
        # Single-process reference: the mean token loss over the whole global batch.
        ref = build_gpt_model(**kw)
        ref.load_state_dict(model.state_dict())
        every = [_per_token_batch(s) for s in range(dp * micro)]
        loss = sum(_token_loss_sum(ref, b) for b in every) / sum(b["loss_mask"].sum() for b in every)
        loss.backward()
        ref_grad = {n: p.grad.reshape(-1) for n, p in ref.named_parameters()}
        return [(pc.name, pc.grad.clone(), ref_grad[pc.name][pc.start:pc.end].clone()) for pc in opt.pieces]
    finally:
        Utils.destroy_model_parallel()


def test_per_token_loss_sums_over_dp_like_megatron(spawn):
    # calculate_per_token_loss: megatron-core's DDP sums gradients over DP and finalize_model_grads divides by
    # the global token count. Backends average, so without the ODO's factor-P compensation every gradient
    # would be 1/DP of the reference. Tolerance: the reference sums the same 4 micro-batches' fp32 gradients
    # in another order, a few ulps of the largest term; 1e-5 of the largest gradient leaves ~100x margin.
    per_rank = spawn(_per_token_grads, 2)
    scale = max(r.abs().max().item() for pieces in per_rank for _, _, r in pieces)
    for pieces in per_rank:
        for name, got, ref in pieces:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * scale, msg=name)


# -- ZeRO-3 (and hpZ) through megatron-core's schedules, with TP, PP, recomputation and Ladder ---------------------
def _zero3_vs_zero2(tp, pp, tied, hpz, model_kw):
    z3 = mx.ShardingPlan.zero3(hpz=hpz)
    return (_train(tp, 4, pp, tied, **model_kw)[0], _train(tp, 4, pp, tied, sharding=z3, **model_kw))


ZERO3_CASES = {
    "tp1": (1, 1, False, 2, {}),
    "tp2": (2, 1, False, 1, {}),
    "pp2_tied": (1, 2, True, 2, {}),
    "full_recompute": (1, 1, False, 2, {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1}),
    "selective_recompute": (1, 1, False, 2, {"recompute_granularity": "selective"}),
    "ladder_tp2": (2, 1, False, 1, {"ladder_residual": True}),
}


@pytest.mark.parametrize("case", list(ZERO3_CASES))
def test_zero3_gpt_matches_zero2_through_megatron_schedules(spawn, case):
    tp, pp, tied, hpz, model_kw = ZERO3_CASES[case]
    per_rank = spawn(_zero3_vs_zero2, 4, tp, pp, tied, hpz, model_kw)
    z2, (z3, _, tied_weight, _) = per_rank[0]
    assert z3[-1] < z3[0], z3
    # The same sums in the same order: ZeRO-3 only changes where the weights live between uses.
    torch.testing.assert_close(torch.tensor(z3), torch.tensor(z2), rtol=1e-6, atol=1e-6)
    if tied:   # both copies of the pipeline-tied embedding stay identical
        assert torch.equal(per_rank[0][1][2], per_rank[-1][1][2])


def test_attach_to_schedules_needs_a_megatron_config():
    """The schedule hooks live on the innermost module's TransformerConfig; a model without one is a clear error."""
    from megatron_ext.optimizer.megatron_config import attach_to_schedules

    with pytest.raises(ValueError, match="no module with a megatron-core config"):
        attach_to_schedules(torch.nn.Sequential(torch.nn.Linear(2, 2)), object())
