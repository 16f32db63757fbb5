"""pretrain_gpt's flags: Megatron-LM names accepted, unknown/unsupported/conflicting flags rejected by name."""
from __future__ import annotations

import os

import pytest

from megatron_ext.training.arguments import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10"]


PP2_8 = ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]   # (the later --num-layers wins)


def test_interleaved_pipeline_flags_as_megatron_lm_reads_them():
    def chunks(*extra):
        args = parse_args(BASE + PP2_8 + ["--global-batch-size", "8", *extra], world_size=4)
        return args.virtual_pipeline_model_parallel_size, getattr(args, "microbatch_group_size_per_vp_stage", None)

    assert chunks() == (None, None)
    assert chunks("--num-layers-per-virtual-pipeline-stage", "2") == (2, 2)   # 4 layers per stage, 2 per chunk
    assert chunks("--num-virtual-stages-per-pipeline-rank", "4") == (4, 2)
    assert chunks("--num-layers-per-virtual-pipeline-stage", "4") == (None, None)   # one chunk: plain 1F1B
    assert chunks("--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "16",   # 4 micro-batches
                  "--microbatch-group-size-per-virtual-pipeline-stage", "4") == (2, 4)


def _tiny_data(prefix: str, documents: int = 40) -> str:
    """A preprocessed ``--data-path`` prefix of ``documents`` short documents (ids below 200)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in range(documents):
        builder.add_document(np.arange(1, 70, dtype=np.int32) + d, [69])
    builder.finalize(prefix + ".idx")
    return prefix


def _error(capsys, argv, world_size=4) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + argv, world_size=world_size)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_megatron_flags_accepted_and_derived_values():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--global-batch-size", "16", "--bf16",
                              "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                              "--ranks-per-node", "2", "--grad-reduce", "plain", "--odo-accumulate", "local"],
                      world_size=8)
    assert args.data_parallel_size == 4
    assert args.num_micro_batches == 2
    assert args.dp_ranks_per_node == 1  # a 2-rank node holds one TP=2 group, i.e. one member of each DP group
    assert args.ffn_hidden_size == 256 and args.max_position_embeddings == 64
    assert args.use_overlapped_distributed_optimizer


@pytest.mark.parametrize("env, flag, engine", [(None, [], True), ("0", [], False),
                                               ("0", ["--odo-progress-engine"], True),
                                               (None, ["--no-odo-progress-engine"], False)])
def test_progress_engine_setting_is_resolved_for_the_arguments_table(monkeypatch, env, flag, engine):
    if env is None:
        monkeypatch.delenv("MEGATRON_EXT_PROGRESS_ENGINE", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_EXT_PROGRESS_ENGINE", env)
    assert parse_args(BASE + flag, world_size=2).odo_progress_engine is engine


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    assert "--use-overlapped-distributed-optimizer" in capsys.readouterr().out


@pytest.mark.parametrize("argv, names", [
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--hiden-size", "3"], ["--hiden-size", "did you mean --hidden-size"]),
    (["--num-experts", "8"], ["--num-experts", "mixture-of-experts"]),
    (["--context-parallel-size", "2"], ["--context-parallel-size"]),
])
def test_unknown_and_unsupported_flags_named(capsys, argv, names):
    err = _error(capsys, argv)
    for n in names:
        assert n in err


@pytest.mark.parametrize("argv, names", [
    (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
    (["--qgz-bits", "8"], ["--qgz-bits", "--grad-reduce"]),
    (["--qgz-pipeline-stages", "auto"], ["--qgz-pipeline-stages", "--grad-reduce"]),
    (["--grad-reduce", "qgz", "--qgz-pipeline-stages", "0"], ["--qgz-pipeline-stages", "positive integer or auto"]),
    (["--quant-group-size", "256"], ["--quant-group-size"]),
    (["--global-batch-size", "6"], ["--global-batch-size", "--micro-batch-size"]),
    (["--tensor-model-parallel-size", "3"], ["--tensor-model-parallel-size"]),
    (["--save-interval", "5"], ["--save-interval", "--save"]),
    (["--overlap-param-gather"], ["--overlap-param-gather", "--overlap-grad-reduce"]),
    (["--mock-data", "--data-path", "x"], ["--mock-data", "--data-path"]),
    (["--data-path", "x"], ["--tokenizer-type"]),
    (["--lr-warmup-iters", "10"], ["--lr-warmup-iters", "--lr-decay-iters"]),
    (["--ranks-per-node", "3"], ["--ranks-per-node"]),
    (["--hpz-partition-size", "2"], ["--hpz-partition-size", "--param-shard-size"]),
    (["--param-shard-size", "2", "--optim-shard-size", "4"], ["--param-shard-size", "not implemented"]),
    (["--param-shard-size", "4", "--hpz-partition-size", "3"], ["--hpz-partition-size", "must divide"]),
    (["--param-shard-size", "4", "--odo-accumulate", "local"], ["--odo-accumulate", "--param-shard-size"]),
    (["--optim-shard-size", "3"], ["--optim-shard-size", "does not divide"]),
    (["--optim-shard-size", "2", "--grad-shard-size", "4"], ["--grad-shard-size", "param <= grad <= optim"]),
    (["--optim-shard-size", "4", "--ranks-per-node", "2", "--grad-shard-size", "2"],
     ["--grad-shard-size", "s_g in {s_p, s_os}"]),
    (["--optim-shard-size", "2", "--odo-accumulate", "shard", "--grad-shard-size", "1"],
     ["--odo-accumulate", "--grad-shard-size"]),
    (["--num-distributed-optimizer-instances", "2", "--optim-shard-size", "4"],
     ["--num-distributed-optimizer-instances", "--optim-shard-size"]),
    (["--num-distributed-optimizer-instances", "3"], ["--num-distributed-optimizer-instances"]),
    (["--ladder-residual-layers", "1"], ["--ladder-residual-layers", "--ladder-residual"]),
    (["--ladder-residual", "--desync-residual", "2x"], ["--ladder-residual", "--desync-residual"]),
    (["--ladder-residual", "--ladder-residual-layers", "5"], ["--ladder-residual-layers", "--num-layers"]),
    (["--ladder-residual", "--sequence-parallel", "--tensor-model-parallel-size", "2"], ["--sequence-parallel"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--transformer-impl", "local"],
     ["--sequence-parallel", "--transformer-impl"]),
    (["--grad-reduce", "nonsense"], ["--grad-reduce"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-layers-per-virtual-pipeline-stage", "needs --pipeline-model-parallel-size > 1, got 1"]),
    (PP2_8 + ["--num-layers-per-virtual-pipeline-stage", "3"], ["must divide the layers per pipeline stage (4 ="]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank conflict"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"],
     ["--pipeline-model-parallel-size > 2 with --no-overlap-p2p-communication"]),
    (PP2_8 + ["--microbatch-group-size-per-virtual-pipeline-stage", "2"], ["applies to the interleaved pipeline"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4"],   # 1 micro-batch
     ["needs at least --pipeline-model-parallel-size (2) micro-batches per step, got 1"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8",
              "--microbatch-group-size-per-virtual-pipeline-stage", "3"],
     ["--microbatch-group-size-per-virtual-pipeline-stage (3) must be between --pipeline-model-parallel-size (2)"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "12"],  # 3 = 2 + 1
     ["micro-batches per step (3) to be a multiple of --pipeline-model-parallel-size (2); change"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "20",   # 5 = 4 + 1
              "--microbatch-group-size-per-virtual-pipeline-stage", "4"],
     ["micro-batches per step (5) to be a multiple of --microbatch-group-size-per-virtual-pipeline-stage (4), or"]),
    (PP2_8 + ["--num-layers-per-virtual-pipeline-stage", "4", "--microbatch-group-size-per-virtual-pipeline-stage",
              "2"], ["applies to the interleaved pipeline only (--num-layers-per-virtual-pipeline-stage 4 gives one"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--auto-plan", "--plan-hardware", "dgx-a100"],
     ["--num-virtual-stages-per-pipeline-rank does not work with --auto-plan"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--ladder-residual"],
     ["--num-virtual-stages-per-pipeline-rank does not work with --ladder-residual"]),
    (PP2_8 + ["--num-virtual-stages-per-pipeline-rank", "2", "--recompute-granularity", "full", "--recompute-method",
              "uniform", "--recompute-num-layers", "3"], ["layers per pipeline stage chunk (2), got 3"]),
    (["--virtual-pipeline-model-parallel-size", "2"], ["--num-virtual-stages-per-pipeline-rank"]),
    (["--ckpt-step", "2"], ["--ckpt-step needs --load"]),
    (["--ckpt-step", "-1", "--load", "."], ["--ckpt-step must be at least 0, got -1"]),
])
def test_conflicting_or_invalid_flags_named(capsys, argv, names):
    err = _error(capsys, argv)
    for n in names:
        assert n in err, err


def test_plan_flags_build_the_plan():
    from megatron_ext import ShardingPlan
    from megatron_ext.training.arguments import sharding_plan_from_args

    args = parse_args(BASE + ["--optim-shard-size", "2", "--odo-accumulate", "local", "--ranks-per-node", "2"],
                      world_size=8)
    assert sharding_plan_from_args(args, 8, 2) == ShardingPlan.amsp_7b(2)
    args = parse_args(BASE + ["--num-distributed-optimizer-instances", "2"], world_size=8)
    assert sharding_plan_from_args(args, 8, 8) == ShardingPlan.mics(4)
    args = parse_args(BASE, world_size=8)
    assert sharding_plan_from_args(args, 8, 8) == ShardingPlan()
    args = parse_args(BASE + ["--param-shard-size", "4", "--hpz-partition-size", "2", "--ranks-per-node", "4"],
                      world_size=4)
    assert sharding_plan_from_args(args, 4, 4) == ShardingPlan(param=4, grad=4, optim=4, hpz=2)


@pytest.mark.parametrize("flag, stages", [([], 2), (["--qgz-pipeline-stages", "1"], 1),
                                          (["--qgz-pipeline-stages", "auto"], None)])
def test_qgz_pipeline_stages_reach_the_config(flag, stages):
    from megatron_ext.training.pretrain_gpt import _overlap_config

    args = parse_args(BASE + ["--grad-reduce", "qgz"] + flag, world_size=4)
    assert _overlap_config(args).qgz_pipeline_stages == stages


def test_ring_reduce_scatter_reaches_the_config():
    from megatron_ext.training.pretrain_gpt import _overlap_config

    assert _overlap_config(parse_args(BASE + ["--grad-reduce", "ring"], world_size=4)).grad_reduce == "ring"


def test_unimplemented_backend_rejected_by_flag_name(capsys, monkeypatch):
    import megatron_ext.comm as comm

    monkeypatch.setattr(comm, "available_grad_reduce", lambda: ["plain"])
    monkeypatch.setattr(comm, "available_param_gather", lambda: ["plain"])
    err = _error(capsys, ["--grad-reduce", "qgz"])
    assert "--grad-reduce qgz is not implemented" in err
    err = _error(capsys, ["--param-gather", "qwz"])
    assert "--param-gather qwz is not implemented" in err


@pytest.mark.parametrize("split", ["99,1", "1,1", "100", "969, 30, 1", "98/2/0"])
def test_split_with_fewer_than_three_weights_is_valid(split):
    from megatron_ext.training.data import parse_split

    assert parse_split(parse_args(BASE + ["--split", split], world_size=1).split) == [
        float(w) for w in split.replace("/", ",").split(",")] + [0.0] * (3 - len(split.replace("/", ",").split(",")))


@pytest.mark.parametrize("split, reason", [("1,2,3,4", "1 to 3"), ("a,1", "not a number"), ("-1,1", "non-negative"),
                                           ("0,1,0", "train split no data"), ("nan", "non-negative")])
def test_bad_split_rejected_before_any_process_group(capsys, split, reason):
    err = _error(capsys, [f"--split={split}"], world_size=1)
    assert "--split" in err and reason in err, err


def _word_tokenizer(path, tokens) -> str:
    """A tokenizer.json of a word-level vocabulary ``tokens`` (ids in order)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])).save(str(path))
    return str(path)


def test_null_tokenizer_needs_vocab_size_and_vocab_size_warns_elsewhere(capsys, tmp_path):
    err = _error(capsys, ["--mock-data", "--tokenizer-type", "NullTokenizer"])
    assert "--vocab-size" in err and "NullTokenizer" in err
    tok = _word_tokenizer(tmp_path / "tokenizer.json", ["<unk>", "<|endoftext|>", "a"])
    data = _tiny_data(str(tmp_path / "x_text_document"))
    parse_args(BASE + ["--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok,
                       "--vocab-size", "100", "--split", "8,1,1"], world_size=1)
    assert "WARNING: --vocab-size 100 is ignored" in capsys.readouterr().err
    parse_args(BASE + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], world_size=1)
    assert "--vocab-size" not in capsys.readouterr().err


def test_scheduler_flags_megatron_names_and_conflict(capsys):
    a = parse_args(BASE + ["--override-opt_param-scheduler"], world_size=1)
    assert a.override_opt_param_scheduler and not a.use_checkpoint_opt_param_scheduler
    a = parse_args(BASE + ["--use-checkpoint-opt_param-scheduler"], world_size=1)
    assert a.use_checkpoint_opt_param_scheduler and not a.override_opt_param_scheduler
    err = _error(capsys, ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-scheduler" in err


def test_ladder_and_desync_flags_reach_the_args():
    a = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--desync-residual", "2x"], world_size=2)
    assert a.desync_residual == "2x" and not a.ladder_residual
    a = parse_args(BASE + ["--ladder-residual", "--ladder-residual-layers", "1"], world_size=2)
    assert a.ladder_residual and a.ladder_residual_layers == 1
    # at TP 1 nothing is overlapped: trained as asked, with a notice saying so (and none at TP 2)
    assert "--ladder-residual at --tensor-model-parallel-size 1: there is no tensor-parallel all-reduce" in (
        getattr(a, "ladder_notice", None) or "")
    tp2 = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--ladder-residual"], world_size=2)
    assert getattr(tp2, "ladder_notice", None) is None


def test_desync_with_transformer_engine_at_tp2_rejected_up_front(capsys, monkeypatch):
    import megatron_ext.training.arguments as arguments

    monkeypatch.setattr(arguments, "_importable", lambda name: True)  # as on a GPU machine with TE installed
    err = _error(capsys, ["--desync-residual", "2x", "--tensor-model-parallel-size", "2"])
    assert "--desync-residual" in err and "--transformer-impl local" in err
    args = parse_args(BASE + ["--desync-residual", "2x", "--tensor-model-parallel-size", "2",
                              "--transformer-impl", "local"], world_size=4)
    assert args.transformer_impl == "local"


def test_dp_ranks_per_node_from_the_actual_dp_groups():
    import argparse

    from megatron_ext.training.arguments import ArgumentError, dp_ranks_per_node

    def per_node(world, rpn, tp, dp):
        return dp_ranks_per_node(argparse.Namespace(ranks_per_node=rpn, world_size=world,
                                                    tensor_model_parallel_size=tp, data_parallel_size=dp))

    assert per_node(8, 2, 1, 4) == 2       # two nodes of two DP ranks
    assert per_node(8, 2, 2, 4) == 1       # a node holds one TP group: one member of each DP group
    assert per_node(16, 8, 1, 4) == 4      # a node holds two whole pipeline stages
    with pytest.raises(ArgumentError, match="--ranks-per-node"):
        per_node(24, 12, 2, 4)             # stage 1 (ranks 8-15) straddles nodes 0 and 1


def test_layouts_megatron_lm_runs_are_one_node_per_dp_group_from_local_world_size(monkeypatch, capsys):
    """A pipeline stage or a TP group across nodes, found from torchrun's LOCAL_WORLD_SIZE, runs (Megatron-LM runs
    it): each DP group is one node, said in a notice; the same layout given as --ranks-per-node stays an error."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2"], world_size=24)   # 3 nodes x 8, PP 2
    assert args.dp_ranks_per_node == args.data_parallel_size == 12
    assert "LOCAL_WORLD_SIZE (8)" in args.topology_notice and "--ranks-per-node" in args.topology_notice
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2"], world_size=2)       # TP across 2 nodes of 1
    assert args.dp_ranks_per_node == 1 and "TP group" in args.topology_notice
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not hasattr(parse_args(BASE, world_size=16), "topology_notice")               # a regular layout
    err = _error(capsys, ["--pipeline-model-parallel-size", "2", "--ranks-per-node", "8"], world_size=24)
    assert "--ranks-per-node (8)" in err and "uneven ranks per node" in err


def test_tokenizer_problems_are_flag_errors_before_training(capsys, tmp_path):
    """A tokenizer that cannot be loaded is a parse error naming the flag (before any process group exists)."""
    err = _error(capsys, ["--data-path", "x", "--tokenizer-type", "HuggingFaceTokenizer"])
    assert "--tokenizer-model" in err
    err = _error(capsys, ["--data-path", "x", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          str(tmp_path / "missing.json")])
    assert "--tokenizer-model" in err and "no tokenizer.json" in err
    no_eos = _word_tokenizer(tmp_path / "no_eos.json", ["<unk>", "a", "b"])
    err = _error(capsys, ["--data-path", "x", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          no_eos])
    assert "--tokenizer-model" in err and "end-of-sequence" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    err = _error(capsys, ["--data-path", "x", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          str(tmp_path / "bad")])
    assert "--tokenizer-model" in err and "is not a tokenizer.json" in err
    (tmp_path / "cfg").mkdir()
    _word_tokenizer(tmp_path / "cfg" / "tokenizer.json", ["<unk>", "</s>"])
    (tmp_path / "cfg" / "tokenizer_config.json").write_text("{broken")
    err = _error(capsys, ["--data-path", "x", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          str(tmp_path / "cfg")])
    assert "--tokenizer-model" in err and "not valid JSON" in err
    (tmp_path / "cfg" / "tokenizer_config.json").write_text('["a list"]')   # not an object: no eos_token there
    parse_args(BASE + ["--data-path", _tiny_data(str(tmp_path / "x")), "--split", "8,1,1", "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "cfg")], world_size=1)


def test_swiglu_ffn_default_is_megatron_lm_rule(capsys):
    a = parse_args(["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "64",
                    "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "10", "--swiglu"], world_size=1)
    assert a.ffn_hidden_size == 10880   # int((4 * 4096 * 2 / 3) / 64) * 64, Megatron-LM's arguments.py
    assert parse_args(BASE + ["--swiglu"], world_size=1).ffn_hidden_size == 128   # 170.7 -> 128
    assert parse_args(BASE, world_size=1).ffn_hidden_size == 256                  # 4h without SwiGLU
    assert parse_args(BASE + ["--swiglu", "--ffn-hidden-size", "96"], world_size=1).ffn_hidden_size == 96
    err = _error(capsys, ["--hidden-size", "16", "--swiglu"], world_size=1)   # 42.7 rounds to 0
    assert "--ffn-hidden-size" in err and "--swiglu" in err
    from megatron_ext.planner.model_spec import ModelSpec
    assert ModelSpec("t", 2, 4096, 32, 1000, 64, swiglu=True).ffn == 10880   # the planner sizes the same model


def test_group_query_attention_defaults_to_one_group_like_megatron_lm(capsys):
    assert parse_args(BASE + ["--group-query-attention"], world_size=1).num_query_groups == 1
    err = _error(capsys, ["--group-query-attention", "--num-query-groups", "3"], world_size=1)
    assert "--num-query-groups" in err and "divide" in err


@pytest.mark.parametrize("argv, flag", [
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--global-batch-size", "-4"], "--global-batch-size"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size"),
    (["--kv-channels", "-1"], "--kv-channels"),
    (["--lr-warmup-iters", "-2"], "--lr-warmup-iters"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters"),
    (["--eval-iters", "-1"], "--eval-iters"),
    (["--exit-interval", "-5"], "--exit-interval"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout"),
    (["--attention-dropout", "-0.1"], "--attention-dropout"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--clip-grad", "-1"], "--clip-grad"),
    (["--lr", "-1e-3"], "--lr"),
    (["--finetune"], "--load"),
    (["--skip-train", "--eval-iters", "0"], "--skip-train"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale"),
    (["--fp16", "--initial-loss-scale", "-1"], "--initial-loss-scale"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by"),
    (["--decoupled-min-lr", "1e-4"], "--decoupled-lr"),
    (["--param-shard-size", "0"], "--param-shard-size"),   # 0 is not "every rank"
    (["--param-shard-size", "1", "--hpz-partition-size", "0"], "--hpz-partition-size"),
    (["--num-distributed-optimizer-instances", "0"], "--num-distributed-optimizer-instances"),
    (["--decoupled-lr", "1e-5", "--decoupled-min-lr", "1e-4"], "--decoupled-lr"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction"),
    (["--lr-warmup-fraction", "1.0"], "--lr-warmup-fraction"),
    (["--start-weight-decay", "0.1"], "--weight-decay-incr-style"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0"], "--end-weight-decay"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_out_of_range_values_name_their_flag(capsys, argv, flag):
    err = _error(capsys, argv, world_size=1)
    assert flag in err, err


def test_megatron_lm_flags_with_reasons_and_accepted_no_ops(capsys):
    for flag, reason in (("--fp8-format", "FP8"), ("--reset-attention-mask", "causal")):
        err = _error(capsys, [flag, "1"], world_size=1)
        assert f"{flag} is a Megatron-LM flag that pretrain_gpt does not support" in err and reason in err, err
        assert "did you mean" not in err
    a = parse_args(BASE + ["--no-gradient-accumulation-fusion", "--lr-warmup-fraction", "0.25",
                           "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0",
                           "--end-weight-decay", "0.1", "--exit-signal-handler"], world_size=1)
    assert a.lr_warmup_fraction == 0.25 and (a.start_weight_decay, a.end_weight_decay) == (0.0, 0.1)
    a = parse_args(BASE + ["--weight-decay", "0.05"], world_size=1)
    assert (a.start_weight_decay, a.end_weight_decay, a.weight_decay_incr_style) == (0.05, 0.05, "constant")


def test_unusable_save_directory_is_a_flag_error(capsys, tmp_path):
    (tmp_path / "a_file").write_text("x")
    err = _error(capsys, ["--save", str(tmp_path / "a_file" / "ckpt")], world_size=1)
    assert "--save" in err and "not a directory" in err
    assert parse_args(BASE + ["--save", str(tmp_path / "new" / "deeper")], world_size=1).save   # creatable


def test_recompute_flags_follow_megatron_lm(capsys):
    assert parse_args(BASE + ["--recompute-activations"], world_size=1).recompute_granularity == "selective"
    a = parse_args(BASE + ["--recompute-granularity", "full", "--recompute-method", "block",
                           "--recompute-num-layers", "2"], world_size=1)
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "block", 2)
    for argv, flag in ((["--recompute-granularity", "full", "--recompute-num-layers", "1"], "--recompute-method"),
                       (["--recompute-granularity", "full", "--recompute-method", "uniform"], "--recompute-num-layers"),
                       (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                         "3"], "--recompute-num-layers"),   # 2 layers
                       (["--recompute-method", "uniform"], "--recompute-method"),
                       (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations")):
        err = _error(capsys, argv, world_size=1)
        assert flag in err, (argv, err)


def test_speed_and_logging_flags_are_accepted_and_named_in_a_notice():
    from megatron_ext.training.arguments import ACCEPTED_WITHOUT_EFFECT, ignored_flag_notice

    argv = []
    for flag, (takes_value, _) in ACCEPTED_WITHOUT_EFFECT.items():
        argv += [flag, "1"] if takes_value else [flag]
    notice = ignored_flag_notice(parse_args(BASE + argv, world_size=1))
    assert notice.startswith("> accepted without effect: ")
    for flag in ACCEPTED_WITHOUT_EFFECT:
        assert f"{flag} (" in notice, flag
    assert ignored_flag_notice(parse_args(BASE, world_size=1)) is None
    notice = ignored_flag_notice(parse_args(BASE + ["--no-masked-softmax-fusion", "--num-workers", "2"],
                                            world_size=1))
    assert notice == ("> accepted without effect: --no-masked-softmax-fusion (this fusion is always off here); "
                      "--num-workers (batches are read in the training process)")


def test_model_flags_of_megatron_lm_reach_the_transformer_config(capsys):
    """--squared-relu, --qk-layernorm, --init-method-xavier-uniform, --attention-softmax-in-fp32 and the older
    position-embedding spellings set what Megatron-LM sets; --apply-layernorm-1p needs Transformer Engine."""
    import torch
    from megatron.core.activations import squared_relu

    from megatron_ext.training.model import config_overrides

    assert parse_args(BASE + ["--use-rotary-position-embeddings"], world_size=1).position_embedding_type == "rope"
    assert parse_args(BASE + ["--no-position-embedding"], world_size=1).position_embedding_type == "none"
    assert parse_args(BASE + ["--no-position-embedding", "--use-rotary-position-embeddings"],
                      world_size=1).position_embedding_type == "rope"
    assert "--squared-relu" in _error(capsys, ["--swiglu", "--squared-relu"], world_size=1)
    assert "--apply-layernorm-1p" in _error(capsys, ["--apply-layernorm-1p", "--transformer-impl", "local"],
                                            world_size=1)
    args = parse_args(BASE + ["--squared-relu", "--qk-layernorm", "--init-method-xavier-uniform",
                              "--attention-softmax-in-fp32"], world_size=1)
    config, plain = config_overrides(args), config_overrides(parse_args(BASE, world_size=1))
    assert config["activation_func"] is squared_relu and config["qk_layernorm"] and config["attention_softmax_in_fp32"]
    assert config["init_method"] is config["output_layer_init_method"] is torch.nn.init.xavier_uniform_
    for key in ("activation_func", "qk_layernorm", "attention_softmax_in_fp32", "init_method"):
        assert key not in plain, key


def test_unsupported_megatron_lm_flags_say_why(capsys):
    for flag in ("--calculate-per-token-loss", "--reset-attention-mask", "--data-args-path", "--fp8-format",
                 "--use-checkpoint-args", "--apply-residual-connection-post-layernorm", "--recompute-modules mlp"):
        err = _error(capsys, flag.split(), world_size=1)
        assert f"{flag.split()[0]} is a Megatron-LM flag that pretrain_gpt does not support: " in err, err


def test_unwritable_save_directory_is_found_by_a_real_write(capsys, tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)   # what a read-only mount or another owner's directory does
    err = _error(capsys, ["--save", str(tmp_path / "ckpt")], world_size=1)
    assert "--save" in err and "cannot write into" in err and "Permission denied" in err


def test_missing_load_directory_fails_before_any_process_group(capsys, tmp_path):
    """--load naming no directory is an argument error; --load = --save with nothing saved yet is a fresh start
    (unless --exit-on-missing-checkpoint); what is in an existing directory is judged later, by all ranks."""
    missing = str(tmp_path / "does-not-exist")
    assert f"--load {missing}: no such directory" in _error(capsys, ["--load", missing], world_size=1)
    assert parse_args(BASE + ["--load", missing, "--save", missing], world_size=1).load == missing
    err = _error(capsys, ["--load", missing, "--save", missing, "--exit-on-missing-checkpoint"], world_size=1)
    assert f"--load {missing}: no such directory" in err
    assert parse_args(BASE + ["--load", str(tmp_path)], world_size=1).load == str(tmp_path)


def test_warmup_error_says_where_the_decay_iterations_came_from(capsys):
    err = _error(capsys, ["--lr-warmup-iters", "10"])   # BASE: --train-iters 10, no --lr-decay-iters
    assert "--lr-warmup-iters (10) must be smaller than --lr-decay-iters (10, by default --train-iters)" in err
    err = _error(capsys, ["--lr-warmup-iters", "10", "--lr-decay-iters", "5"])
    assert "--lr-decay-iters (5)" in err and "by default" not in err


def test_pipeline_stages_inside_ladder_or_desync_layers_are_named_at_start_up():
    """A stage boundary inside the Ladder layers (or after a Desync module without an all-reduce) changes the
    network; one outside them, or at PP 1, does not."""
    def notice(*extra, pp=2, layers=4):
        args = parse_args(BASE[:1] + [str(layers)] + BASE[2:] + ["--pipeline-model-parallel-size", str(pp),
                                                                 *extra], world_size=pp)
        return getattr(args, "wiring_notice", None)

    assert "after layer(s) 2 inside the Ladder layers" in notice("--ladder-residual")
    assert notice("--ladder-residual", "--ladder-residual-layers", "2") is None     # the stage holds all of them
    assert "after layer(s) 2 inside" in notice("--ladder-residual", "--ladder-residual-layers", "3")
    assert notice("--desync-residual", "2x") is None                                 # every MLP keeps its reduce
    assert notice("--desync-residual", "4x") is None                                 # layer 2's MLP is module 3
    assert "after layer(s) 1, 3 inside the Desync layers" in notice("--desync-residual", "4x", pp=4)
    assert notice("--ladder-residual", pp=1) is None


def test_nan_check_is_on_by_default_as_in_megatron_lm():
    assert parse_args(BASE, world_size=4).check_for_nan_in_loss_and_grad
    assert parse_args(BASE + ["--check-for-nan-in-loss-and-grad"], world_size=4).check_for_nan_in_loss_and_grad
    assert not parse_args(BASE + ["--no-check-for-nan-in-loss-and-grad"],
                          world_size=4).check_for_nan_in_loss_and_grad


@pytest.mark.parametrize("argv", [["--context-parallel-size", "1"], ["--expert-model-parallel-size=1"],
                                  ["--dataloader-type", "single"], ["--recompute-modules", "core_attn"]])
def test_unsupported_flags_accepted_at_their_no_op_value(argv):
    parse_args(BASE + argv + ["--bf16"], world_size=4)


def test_unsupported_flag_at_another_value_names_the_accepted_one(capsys):
    err = _error(capsys, ["--dataloader-type", "cyclic"])
    assert "--dataloader-type" in err and "only --dataloader-type single is accepted" in err
    # the checkpoints are megatron_ext's own layout, whatever format a script asks for
    assert "megatron_ext's reshardable layout" in _error(capsys, ["--ckpt-format", "torch"])


def test_an_argument_error_is_not_buried_under_the_usage(capsys):
    err = _error(capsys, ["--hiden-size", "3"])
    assert "usage:" not in err and len(err.splitlines()) == 2
    assert "error: unrecognized argument --hiden-size" in err and "--help" in err


def test_fp16_only_flags_are_ignored_with_a_warning_without_fp16(capsys):
    args = parse_args(BASE + ["--bf16", "--hysteresis", "2", "--initial-loss-scale", "65536"], world_size=4)
    assert args.bf16 and args.hysteresis == 2
    err = capsys.readouterr().err
    assert "ignored without --fp16 (as in Megatron-LM): --initial-loss-scale, --hysteresis" in err


def test_data_path_error_names_the_tokenizer_preprocess_data_trained(capsys, tmp_path):
    (tmp_path / "x_tokenizer.json").write_text("{}")
    err = _error(capsys, ["--data-path", str(tmp_path / "x_text_document")])
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'x_tokenizer.json'}" in err
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER.json" in _error(
        capsys, ["--data-path", "1.0", str(tmp_path / "y_text_document")])


def test_wsd_schedule_is_megatron_cores(capsys):
    """WSD: warmup, the peak held, then --lr-wsd-decay-iters of decay ending at --min-lr (megatron-core's own
    scheduler, fed the samples Megatron-LM feeds it)."""
    import types

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.training.pretrain_gpt import scheduler_kwargs

    assert "--lr-wsd-decay-iters" in _error(capsys, ["--lr-decay-style", "WSD"])
    assert "--lr-wsd-decay-iters" in _error(capsys, ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "11"])
    args = parse_args(BASE + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style",
                              "linear", "--lr-warmup-iters", "2", "--min-lr", "1e-5", "--global-batch-size", "8"],
                      world_size=4)
    opt = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    sched = OptimizerParamScheduler(opt, **scheduler_kwargs(args))
    lrs = []
    for _ in range(10):
        sched.step(increment=args.global_batch_size)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[:6] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])
    assert lrs[6:] == pytest.approx([1e-5 + (1e-3 - 1e-5) * f for f in (0.75, 0.5, 0.25, 0.0)])
    parse_args(BASE + ["--lr-wsd-decay-iters", "4"], world_size=4)
    assert "--lr-wsd-decay-iters is ignored" in capsys.readouterr().err


def test_sample_based_training_as_megatron_lm(capsys):
    """--train-samples: --train-samples // --global-batch-size iterations, the data sized for the samples, and the
    schedule in samples; a run that gives the same lengths in iterations gets the same scheduler, so the same LR
    at every step. Iteration and sample flags never mix (Megatron-LM asserts; here the error names both)."""
    from megatron_ext.training.data import train_valid_test_num_samples
    from megatron_ext.training.pretrain_gpt import scheduler_kwargs

    iters = BASE[:-2] + ["--global-batch-size", "8", "--lr-decay-style", "WSD", "--min-lr", "1e-5"]
    by_iters = parse_args(iters + ["--train-iters", "12", "--lr-decay-iters", "10", "--lr-warmup-iters", "2",
                                   "--lr-wsd-decay-iters", "4"], world_size=4)
    by_samples = parse_args(iters + ["--train-samples", "96", "--lr-decay-samples", "80", "--lr-warmup-samples",
                                     "16", "--lr-wsd-decay-samples", "32"], world_size=4)
    assert by_samples.train_iters == 12 and scheduler_kwargs(by_samples) == scheduler_kwargs(by_iters)
    odd = parse_args(BASE[:-2] + ["--global-batch-size", "8", "--train-samples", "100",
                                  "--lr-warmup-fraction", "0.1"], world_size=4)
    assert odd.train_iters == 12 and odd.lr_decay_samples == 100   # Megatron-LM: the decay defaults to all samples
    kw = scheduler_kwargs(odd)
    assert (kw["lr_decay_steps"], kw["lr_warmup_steps"], kw["wd_incr_steps"]) == (100, 10.0, 100)
    assert train_valid_test_num_samples(12, 8, 1000, 0, train_samples=100)[0] == 100

    def error(argv):
        with pytest.raises(SystemExit):
            parse_args(BASE[:-2] + ["--global-batch-size", "8"] + argv, world_size=4)
        return capsys.readouterr().err

    assert "give --train-iters or --train-samples" in error([])
    assert "--train-iters and --train-samples conflict" in error(["--train-iters", "2", "--train-samples", "16"])
    assert "--lr-decay-iters counts iters, but this run is given --train-samples: use --lr-decay-samples" in error(
        ["--train-samples", "64", "--lr-decay-iters", "4"])
    assert "--lr-warmup-samples counts samples, but this run is given --train-iters: use --lr-warmup-iters" in error(
        ["--train-iters", "8", "--lr-warmup-samples", "8"])
    assert "--train-samples (4) is less than one --global-batch-size (8)" in error(["--train-samples", "4"])
    assert "--lr-warmup-samples (64) must be smaller than --lr-decay-samples (64, by default --train-samples)" in \
        error(["--train-samples", "64", "--lr-warmup-samples", "64"])
    assert "--lr-decay-style WSD needs --lr-wsd-decay-samples" in error(["--train-samples", "64", "--lr-decay-style",
                                                                         "WSD"])


def test_per_split_data_paths_are_checked_with_the_flags(capsys, tmp_path):
    prefix = _tiny_data(str(tmp_path / "tiny_text_document"))
    tok = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
    args = parse_args(BASE + tok + ["--train-data-path", prefix, "--valid-data-path", "1.0", prefix], world_size=4)
    assert args.data_notice is None and args.valid_data_path == ["1.0", prefix]
    assert "no --valid-data-path: no validation during training" in parse_args(BASE + tok + ["--train-data-path", prefix],
                                                                      world_size=4).data_notice
    parse_args(BASE + tok + ["--train-data-path", prefix, "--split", "8,1,1"], world_size=4)
    assert "--split 8,1,1 is ignored" in capsys.readouterr().err
    assert "--data-path conflicts with --train-data-path" in _error(capsys, tok + ["--data-path", prefix,
                                                                                   "--train-data-path", prefix])
    assert "need --train-data-path" in _error(capsys, tok + ["--valid-data-path", prefix])
    assert f"--valid-data-path {prefix}x: missing {prefix}x.bin" in _error(
        capsys, tok + ["--train-data-path", prefix, "--valid-data-path", prefix + "x"])
    assert "--train-data-path needs --tokenizer-type" in _error(capsys, ["--train-data-path", prefix])
    assert "nothing to evaluate" in _error(capsys, tok + ["--train-data-path", prefix, "--skip-train"])
    train = _tiny_data(str(tmp_path / "train_text_document"))
    with open(prefix + ".idx", "r+b") as f:   # a damaged index: named with its own flag
        f.write(b"garbage!")
    assert f"--valid-data-path {prefix}: its index file is not a megatron-core .idx" in _error(
        capsys, tok + ["--train-data-path", train, "--valid-data-path", prefix])


def test_tokenizer_files_without_a_tokenizer_type_are_an_error(capsys):
    err = _error(capsys, ["--vocab-file", "v.json", "--merge-file", "m.txt"])
    assert "--vocab-file and --merge-file without --tokenizer-type" in err


def test_data_files_and_splits_checked_with_the_flags(capsys, tmp_path):
    """Before any process group: a missing .bin/.idx and a split the run needs left empty are errors naming the
    flag; a split it does not need (test), left empty, is named in a start-up notice."""
    err = _error(capsys, ["--data-path", str(tmp_path / "none_text_document"), "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "64"])
    assert "--data-path" in err and "missing" in err
    prefix = _tiny_data(str(tmp_path / "tiny_text_document"))
    flags = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
    args = parse_args(BASE + flags, world_size=4)   # the default 969,30,1 of 40 documents: no test documents
    assert args.data_notice.startswith("> --split 969,30,1 leaves the test split")
    assert "not evaluated" in args.data_notice
    assert parse_args(BASE + flags + ["--split", "8,1,1"], world_size=4).data_notice is None
    assert "--split" in _error(capsys, flags + ["--split", "999,1,0"])   # no validation documents, --eval-iters 100
    with open(prefix + ".bin", "r+b") as f:   # a truncated copy of the .bin: named, not an error at some sample
        f.truncate(os.path.getsize(prefix + ".bin") - 1)
    err = _error(capsys, flags + ["--split", "8,1,1"])
    assert f"--data-path {prefix}: {prefix}.bin holds" in err and "truncated" in err, err


def test_a_flag_error_is_printed_once_per_node(capsys, monkeypatch):
    """Under torchrun every rank parses the same flags: local rank 0 prints the error, the others exit quietly with
    the same status (eight copies per node, interleaved, buried the message)."""
    from megatron_ext.training import arguments

    waits = []
    monkeypatch.setattr(arguments, "_wait_for_local_rank_0", waits.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _error(capsys, ["--lr", "-1"]) == "" and waits == []   # not under torchrun: nobody to wait for
    # under torchrun a quiet rank waits for local rank 0's exit to stop it, so it cannot stop rank 0 before it printed
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    assert _error(capsys, ["--lr", "-1"]) == "" and waits == [arguments.QUIET_RANK_WAIT_S]
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "--lr" in _error(capsys, ["--lr", "-1"]) and waits == [arguments.QUIET_RANK_WAIT_S]


def test_quant_group_size_that_defeats_the_backends_gets_a_notice():
    """Wider than a weight row (the loss drifts) or so small that the fp32 scales cost as much as plain: said at
    start-up; one row is quiet."""
    def notice(extra):
        return parse_args(BASE + ["--hidden-size", "64"] + extra, world_size=4).quant_notice

    assert "wider than a weight row (--hidden-size 64)" in notice(["--grad-reduce", "qgz"])   # the default 2048
    small = notice(["--grad-reduce", "qgz", "--param-gather", "qwz", "--quant-group-size", "1"])
    assert "qwz sends 5.00 bytes per element against plain's 4" in small and "qgz sends 4.50" in small
    assert notice(["--param-gather", "qwz", "--quant-group-size", "64"]) is None
    assert notice([]) is None   # plain backends: nothing to say
