"""The planner's model against the models pretrain_gpt builds: parameter numels in registration order (the ODO
buckets them in that order, so a wrong order would mean wrong predicted buckets), and FLOPs against a count of
every matmul of a transformer step."""
from __future__ import annotations

import pytest

from megatron_ext.planner.model_spec import ModelSpec

from ..test_utilities import Utils


def _core_gpt_numels():
    """A megatron-core GPT (learned positions, untied output, LayerNorm with bias) from build_gpt_model."""
    from megatron_ext.models import build_gpt_model

    Utils.initialize_model_parallel(1, 1)
    try:
        gpt = build_gpt_model(num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=160, seq_length=24,
                              ffn_hidden_size=80, share_embeddings_and_output_weights=False)
        return [(n, p.numel()) for n, p in gpt.named_parameters()]
    finally:
        Utils.destroy_model_parallel()


def test_param_numels_equal_a_megatron_core_gpt(spawn):
    named = spawn(_core_gpt_numels, 1, timeout=120)[0]
    spec = ModelSpec("t", num_layers=3, hidden_size=48, num_attention_heads=4, vocab_size=160, seq_length=24,
                     ffn_hidden_size=80, untie_embeddings=True)
    assert spec.param_numels() == [n for _, n in named], named
    # the order the spec's docstring promises: positions right after the word embedding, proj before qkv
    names = [n for n, _ in named]
    assert names[1].endswith("position_embeddings.weight") and "linear_proj" in names[4]
    assert "linear_qkv" in names[6] and names[-1] == "output_layer.weight"


# pretrain_gpt flag sets whose model the planner must see exactly (auto_plan.model_spec_from_args): TP 1 and 2,
# tied and untied, RMSNorm + SwiGLU + GQA without biases, explicit head size, a position table longer than the
# sequence, rope (no table), query-key norms (LayerNorm and RMSNorm).
FLAG_SETS = [
    ["--untie-embeddings-and-output-weights", "--max-position-embeddings", "40", "--qk-layernorm"],
    ["--tensor-model-parallel-size", "2", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
     "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--qk-layernorm"],
    ["--tensor-model-parallel-size", "2", "--kv-channels", "8", "--position-embedding-type", "rope"],
]


def _deferred(model) -> int:
    """Elements the ODO would keep in deferred buckets (reduced over a model-parallel group first)."""
    from megatron_ext.optimizer.model_parallel import model_parallel_grad_reductions

    mp = model_parallel_grad_reductions(model)
    return sum(p.numel() for p in model.parameters() if id(p) in mp)


def _pretrain_gpt_numels(flag_sets):
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.auto_plan import model_spec_from_args
    from megatron_ext.training.model import build_model, padded_vocab_size

    out = []
    for flags in flag_sets:
        args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1",
                           "--mock-data", "--vocab-size", "200"] + flags, world_size=2)
        Utils.initialize_model_parallel(args.tensor_model_parallel_size, 1)
        try:
            args.padded_vocab_size = padded_vocab_size(201, args.make_vocab_size_divisible_by,
                                                       args.tensor_model_parallel_size)
            spec = model_spec_from_args(args)
            model = build_model(args)
            built = [p.numel() for p in model.parameters()]
            out.append((spec.param_numels(args.tensor_model_parallel_size), built, spec.vocab_size,
                        args.padded_vocab_size, _deferred(model),
                        spec.stage_deferred_numel(args.tensor_model_parallel_size, 1, 0)))
        finally:
            Utils.destroy_model_parallel()
    return out


def test_pretrain_gpt_flags_give_the_model_pretrain_gpt_builds(spawn):
    for rank_result in spawn(_pretrain_gpt_numels, 2, FLAG_SETS, timeout=180):
        for (predicted, built, vocab, padded, deferred, predicted_deferred), flags in zip(rank_result, FLAG_SETS):
            assert vocab == padded, flags          # NullTokenizer: --vocab-size + 1 (EOD), padded as the model is
            assert predicted == built, flags
            assert deferred == predicted_deferred, flags   # TP 2's query-key norms are summed over TP first
        assert rank_result[1][4] == 2 * 2 * 16   # layers x (q, k) x head size (RMSNorm: a weight only)


def _pipeline_stage_numels(flag_sets):
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.auto_plan import model_spec_from_args
    from megatron_ext.training.model import build_model

    from megatron.core import parallel_state as ps

    out = []
    for flags in flag_sets:
        args = parse_args(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                           "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1",
                           "--mock-data", "--vocab-size", "100", "--pipeline-model-parallel-size", "2"] + flags,
                          world_size=2)
        Utils.initialize_model_parallel(1, 2)
        try:
            args.padded_vocab_size = 128
            spec = model_spec_from_args(args)
            stage = ps.get_pipeline_model_parallel_rank()
            model = build_model(args)
            built = [p.numel() for p in model.parameters()]
            out.append((spec.stage_param_numels(1, 2, stage), built, sum(spec.busiest_stage_numels(1, 2)),
                        _deferred(model), spec.stage_deferred_numel(1, 2, stage)))
        finally:
            Utils.destroy_model_parallel()
    return out


def test_pipeline_stages_hold_what_megatron_core_builds(spawn):
    """PP 2 with 4 layers, tied (the last stage allocates its own output weight) and untied."""
    flag_sets = [[], ["--untie-embeddings-and-output-weights"]]
    per_rank = spawn(_pipeline_stage_numels, 2, flag_sets, timeout=180)
    for i, flags in enumerate(flag_sets):
        stages = [per_rank[r][i] for r in range(2)]
        for predicted, built, _, deferred, predicted_deferred in stages:
            assert predicted == built, flags
            # the tied weight is reduced over the embedding group on both stages ([Note: deferred buffers])
            assert deferred == predicted_deferred == (0 if flags else 128 * 32), flags
        assert stages[0][2] == max(sum(b) for _, b, *_ in stages), flags


def _matmul_flops(L, h, a, g, s, V, f, swiglu=False, d=None):
    """Forward + backward FLOPs of one sequence, counted matmul by matmul (backward = 2 x forward)."""
    d = d or h // a
    q, kv = a * d, g * d
    per_token_layer = 2 * h * (q + 2 * kv) + 2 * q * h        # qkv and output projections
    per_token_layer += 2 * s * q + 2 * s * q                   # scores and weighted values (no causal halving)
    per_token_layer += 2 * h * (2 * f if swiglu else f) + 2 * f * h
    return 3 * s * (L * per_token_layer + 2 * h * V)          # + logits


def test_flops_per_sequence_is_megatrons_formula():
    hand = ModelSpec("t", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                     ffn_hidden_size=256)
    # 12 s L h^2 (1 + g/a + s/h + f/h + V / (2 L h)) = 12*32*2*64^2 * (1 + 1 + 0.5 + 4 + 0.5)
    assert hand.flops_per_sequence() == 22_020_096
    assert _matmul_flops(2, 64, 4, 4, 32, 128, 256) == 22_020_096


@pytest.mark.parametrize("kw", [
    dict(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=1000, seq_length=256),
    dict(num_layers=3, hidden_size=96, num_attention_heads=6, vocab_size=512, seq_length=64, ffn_hidden_size=160,
         num_query_groups=2, swiglu=True),
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=128, kv_channels=24),
], ids=["mha", "gqa-swiglu", "kv-channels"])
def test_flops_equal_a_matmul_count(kw):
    spec = ModelSpec("t", **kw)
    expected = _matmul_flops(spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.query_groups,
                             spec.seq_length, spec.vocab_size, spec.ffn, spec.swiglu, spec.kv_channels)
    assert spec.flops_per_sequence() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("untie", [True, False], ids=["untied", "tied"])
def test_stages_partition_the_model(untie):
    spec = ModelSpec("t", num_layers=10, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                     untie_embeddings=untie)
    assert spec.busiest_stage_numels(2, 1) == spec.param_numels(2)
    stages = [spec.stage_param_numels(1, 4, s) for s in range(4)]
    tied_copy = 0 if untie else 256 * 64       # with PP > 1 the last stage allocates its own output weight
    assert sum(map(sum, stages)) == spec.num_params + tied_copy
    assert sum(spec.busiest_stage_numels(1, 4)) == max(map(sum, stages)) < spec.num_params


@pytest.mark.parametrize("method, n, pp, tp, sp", [
    ("block", 1, 1, 1, False), ("block", 3, 2, 2, True), ("block", 8, 1, 1, False), ("uniform", 1, 1, 1, False),
    ("uniform", 3, 1, 2, True), ("uniform", 4, 2, 1, False), ("uniform", 8, 1, 1, False),
], ids=lambda x: str(x))
def test_activations_follow_the_layers_pretrain_gpt_recomputes(method, n, pp, tp, sp):
    """Full recomputation as pretrain_gpt groups a stage's layers (``recompute_plan.plan_segments``, megatron-core's
    grouping): a checkpointed segment keeps its input only, the other layers everything, plus in backward the
    working set of the largest checkpointed segment."""
    from megatron_ext.transformer.recompute_plan import plan_segments

    spec = ModelSpec("t", num_layers=16, hidden_size=256, num_attention_heads=8, vocab_size=512, seq_length=128)
    kw = dict(tp=tp, pp=pp, micro_batches=4, sequence_parallel=sp)
    layers, in_flight = 16 // pp, min(pp, 4)
    logits = 8 * 128 * 2 * 512 / tp
    per_layer = (spec.activation_bytes(2, **kw) - logits) / (layers * in_flight)
    layer_input = 2 * 128 * 2 * 256 / (tp if sp else 1)
    segments = plan_segments(layers, layers, "full", method, n, training=True)
    expected = logits + max(s.stop - s.start for s in segments if s.checkpointed) * per_layer + in_flight * sum(
        layer_input if s.checkpointed else (s.stop - s.start) * per_layer for s in segments)
    got = spec.activation_bytes(2, recompute="full", recompute_method=method, recompute_num_layers=n, **kw)
    assert got == int(expected)
    # block over every layer of the stage, and uniform chunks of one layer: the old "every layer" model
    every = spec.activation_bytes(2, recompute="full", **kw)
    assert every == spec.activation_bytes(2, recompute="full", recompute_method="uniform", recompute_num_layers=1,
                                          **kw) == spec.activation_bytes(2, recompute="full", recompute_method="block",
                                                                         recompute_num_layers=layers, **kw)
    if method == "block" and n < layers:
        assert got > every


def test_block_recomputation_costs_only_its_layers_forward():
    """The recomputed forward is charged for the recomputed layers: block over 1 of 32 layers adds 1/32 of a
    forward, uniform all of it."""
    from megatron_ext.planner import Candidate, hardware_preset, model_preset, predict
    from megatron_ext.planner.cli import workload_from

    spec, prof = model_preset("llama-7b"), hardware_preset("dgx-a100")
    cand = Candidate(1, 8, 8, 1, "plain", "plain", 4, 40_000_000)

    def compute_s(**kw):
        wl = workload_from(spec, gpus=8, gpus_per_node=8, micro_batch=1, global_batch=8, **kw)
        return predict(cand, wl, prof).compute_s

    none, uniform = compute_s(), compute_s(recompute="full", recompute_method="uniform", recompute_num_layers=2)
    block = compute_s(recompute="full", recompute_method="block", recompute_num_layers=1)
    forward = (uniform - none)          # one whole forward, a third of a step's model compute
    assert forward > 0 and block - none == pytest.approx(forward / 32, rel=1e-9)
