"""A megatron-core GPTModel trains with the ODO through megatron-core's own schedule and finalize_model_grads."""
import torch
import torch.distributed as dist

import megatron_ext as mx

from ..test_utilities import Utils

VOCAB, SEQ, MBS, STEPS = 64, 16, 2, 3


def _train(tp: int, global_micro_batches: int, pp: int = 1, tied: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.models.gpt import build_gpt_model, gpt_forward_step, synthetic_gpt_batch

    Utils.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        dp = ps.get_data_parallel_world_size()
        dp_rank = ps.get_data_parallel_rank()
        gpt = build_gpt_model(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                              share_embeddings_and_output_weights=tied)
        model = mx.OverlappedDDP(gpt, mx.OverlapConfig(bucket_size=4000), dp_group=ps.get_data_parallel_group())
        opt = mx.OverlappedDistributedOptimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0), model)
        cfg = gpt.config
        cfg.no_sync_func = model.no_sync
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.grad_scale_func = opt.scale_loss
        micro = global_micro_batches // dp
        fwd_bwd = get_forward_backward_func()
        losses = []
        for step in range(STEPS):
            batches = [synthetic_gpt_batch(MBS, SEQ, VOCAB, seed=dp_rank * micro + i)  # same data each step: loss must fall
                       for i in range(micro)]
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
        return losses, len(model.buckets), tied_weight
    finally:
        Utils.destroy_model_parallel()


def _both():
    return _train(tp=1, global_micro_batches=4), _train(tp=2, global_micro_batches=4)


def test_gpt_trains_with_odo_and_tp1_equals_tp2(spawn):
    (tp1, tp2) = spawn(_both, 2)[0]
    losses1, nb1, _ = tp1
    losses2, _, _ = tp2
    assert nb1 > 1
    assert losses1[-1] < losses1[0], losses1
    # TP=2 splits the matmuls (and sums partial products in another order): equal to fp32 rounding.
    torch.testing.assert_close(torch.tensor(losses2), torch.tensor(losses1), rtol=1e-4, atol=1e-5)


def _pp2_tied():
    from megatron.core import parallel_state as ps
    losses, _, tied = _train(tp=1, global_micro_batches=4, pp=2, tied=True)
    return losses, tied


def test_pipeline_tied_embeddings_stay_identical(spawn):
    # With PP=2 the word embedding (first stage) and the output layer (last stage) are one tied weight held
    # twice; megatron-core's finalize_model_grads all-reduces ``main_grad``, which a grad-freeing optimizer
    # does not have (the Megatron-LLaMA pitfall: the copies drift apart). The ODO reduces the tied gradient
    # over the embedding group itself, so both copies receive the same update and stay bit-identical.
    per_rank = spawn(_pp2_tied, 4)   # TP=1 x PP=2 x DP=2
    losses = per_rank[0][0]
    assert losses[-1] < losses[0], losses
    first_stage = [r[1] for r in per_rank[:2]]
    last_stage = [r[1] for r in per_rank[2:]]
    for a, b in zip(first_stage, last_stage):
        assert torch.equal(a, b)
