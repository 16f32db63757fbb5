"""pretrain_gpt's flags: Megatron-LM names accepted, unknown/unsupported/conflicting flags rejected by name."""
from __future__ import annotations

import pytest

from megatron_ext.training.arguments import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10"]


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
    (["--loss-scale", "128"], ["--loss-scale", "--fp16"]),
    (["--qgz-bits", "8"], ["--qgz-bits", "--grad-reduce"]),
    (["--quant-group-size", "256"], ["--quant-group-size"]),
    (["--global-batch-size", "6"], ["--global-batch-size", "--micro-batch-size"]),
    (["--tensor-model-parallel-size", "3"], ["--tensor-model-parallel-size"]),
    (["--save-interval", "5"], ["--save-interval", "--save"]),
    (["--overlap-param-gather"], ["--overlap-param-gather", "--overlap-grad-reduce"]),
    (["--mock-data", "--data-path", "x"], ["--mock-data", "--data-path"]),
    (["--data-path", "x"], ["--tokenizer-type"]),
    (["--lr-warmup-iters", "10"], ["--lr-warmup-iters", "--lr-decay-iters"]),
    (["--ranks-per-node", "3"], ["--ranks-per-node"]),
    (["--hpz-partition-size", "2"], ["--hpz-partition-size", "not implemented"]),
    (["--ladder-residual-layers", "1"], ["--ladder-residual-layers", "--ladder-residual"]),
    (["--ladder-residual", "--desync-residual", "2x"], ["--ladder-residual", "--desync-residual"]),
    (["--ladder-residual", "--ladder-residual-layers", "5"], ["--ladder-residual-layers", "--num-layers"]),
    (["--ladder-residual", "--sequence-parallel", "--tensor-model-parallel-size", "2"], ["--sequence-parallel"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--transformer-impl", "local"],
     ["--sequence-parallel", "--transformer-impl"]),
    (["--grad-reduce", "nonsense"], ["--grad-reduce"]),
])
def test_conflicting_or_invalid_flags_named(capsys, argv, names):
    err = _error(capsys, argv)
    for n in names:
        assert n in err, err


def test_unimplemented_backend_rejected_by_flag_name(capsys, monkeypatch):
    import megatron_ext.comm as comm

    monkeypatch.setattr(comm, "available_grad_reduce", lambda: ["plain"])
    monkeypatch.setattr(comm, "available_param_gather", lambda: ["plain"])
    err = _error(capsys, ["--grad-reduce", "qgz"])
    assert "--grad-reduce qgz is not implemented" in err
    err = _error(capsys, ["--param-gather", "qwz"])
    assert "--param-gather qwz is not implemented" in err
