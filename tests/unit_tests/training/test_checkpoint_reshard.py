"""tools/reshard_checkpoint.py: a checkpoint rewritten for other TP/PP sizes resumes as the saving layout trains."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from megatron_ext.training.checkpoint_reshard import (Layout, global_key, local_key, merge_tp, resize_vocab,
                                                      split_tp, target_vocab, tp_problems)
from megatron_ext.training.checkpointing import CheckpointError, TRACKER, verify_checksums

from .conftest import REPO
from .test_checkpoint_resume import _load_error, _runs
from .test_pretrain_gpt import _data_flags

# The shapes a TP split must respect (fused SwiGLU, grouped-query attention) and the tied embedding that PP > 1 keeps
# twice; four layers so that PP 2 with two chunks per stage has one layer per chunk.
MODEL = ["--num-layers", "4", "--swiglu", "--group-query-attention", "--num-query-groups", "2"]


def _reshard(src, dst, tp, pp, *more):
    import importlib.util

    spec = importlib.util.spec_from_file_location("reshard_checkpoint", os.path.join(REPO, "tools",
                                                                                      "reshard_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.main(["--load", src, "--save", dst, "--target-tensor-parallel-size", str(tp),
                      "--target-pipeline-parallel-size", str(pp), *more])


def _tensors(ckpt):
    """Every tensor of every model.pt / optim.pt under ``ckpt``, by file and key path."""
    out = {}

    def walk(obj, path):
        if torch.is_tensor(obj):
            out[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")

    for f in sorted(glob.glob(os.path.join(ckpt, "mp_rank_*", "*.pt"))):
        walk(torch.load(f, map_location="cpu", weights_only=False), os.path.relpath(f, ckpt))
    return out


def _resumes_then_refusal(argvs, refused):
    return _runs(argvs), _load_error(refused)


def test_tp2_pp2_checkpoint_resumes_at_other_layouts(spawn, text_dataset, tiny_model_flags, tmp_path, capsys):
    """Saved at TP 2 x PP 2 (DP 1), iteration 2 of 4; resharded to TP 1 x PP 1 (resumed at DP 2) and to TP 1 x PP 2
    with two chunks per stage: iterations 3 and 4 give the straight run's losses within fp32 rounding. TP changes
    the order of the row-parallel sums, so bits may differ; 1e-5 relative is 100x the gap measured (1e-7), and a
    fused SwiGLU split as a plain column (the halves mixed) moved iteration 3's loss by 2.4e-4 relative.
    Resharded back to TP 2 x PP 2, every tensor equals the source's bit for bit."""
    base = tiny_model_flags + MODEL + _data_flags(text_dataset) + ["--global-batch-size", "8", "--train-iters", "4"]
    ckpt = str(tmp_path / "ckpt")
    ref = spawn(_runs, 4, [base + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--save", ckpt, "--save-interval", "2", "--log-params-norm",
                                   "--log-num-zeros-in-grad"]], timeout=200)[-1][0]
    with open(os.path.join(ckpt, TRACKER), "w") as f:
        f.write("2")
    flat, chunked, back = (str(tmp_path / n) for n in ("tp1pp1", "tp1pp2v2", "back"))
    os.makedirs(os.path.join(flat, "iter_0000002.tmp"))   # a killed reshard's leftover: cleaned, not a checkpoint
    assert _reshard(ckpt, flat, 1, 1) == 0 and not os.path.exists(os.path.join(flat, "iter_0000002.tmp"))
    assert _reshard(ckpt, chunked, 1, 2, "--target-num-virtual-stages-per-pipeline-rank", "2") == 0
    assert _reshard(flat, back, 2, 2) == 0
    for out in (flat, chunked, back):   # published with a manifest whose checksums hold
        assert open(os.path.join(out, TRACKER)).read() == "2"
        assert verify_checksums(os.path.join(out, "iter_0000002")) > 0
    assert not os.path.exists(os.path.join(flat, "iter_0000002", "rng"))
    capsys.readouterr()
    # never into (or inside) the source, nor among other checkpoints; a split through query groups is refused
    for dst, tp, pp in ((ckpt, 1, 1), (os.path.join(ckpt, "inside"), 1, 1), (flat, 1, 1),
                        (str(tmp_path / "tp4"), 4, 1)):
        assert _reshard(ckpt, dst, tp, pp) == 1 and not os.path.exists(os.path.join(ckpt, "inside"))
    err = capsys.readouterr().err
    assert "is the --load directory or inside it" in err and "already holds checkpoints" in err, err
    assert "query groups (--num-query-groups) 2 is not divisible by it" in err and not os.path.exists(tmp_path / "tp4")
    assert _reshard(chunked, str(tmp_path / "pp1"), 1, 1) == 1   # two chunks per stage need PP >= 2: the flag named
    assert "pass --target-num-virtual-stages-per-pipeline-rank" in capsys.readouterr().err
    # --log-params-norm logged the norm of these weights (fp32: the masters), each element once across TP and PP
    full = torch.load(os.path.join(flat, "iter_0000002", "mp_rank_00_000", "model.pt"), weights_only=False)
    norm = sum(t.double().pow(2).sum() for t in full.values() if torch.is_tensor(t)).sqrt().item()
    assert ref["log"][2]["params_norm"] == pytest.approx(norm, rel=1e-9), (ref["log"][2], norm)
    assert isinstance(ref["log"][2]["num_zeros"], int)
    source, again = _tensors(os.path.join(ckpt, "iter_0000002")), _tensors(os.path.join(back, "iter_0000002"))
    assert source.keys() == again.keys() and any("output_layer.weight" in k for k in source)
    for k, t in source.items():
        assert t.dtype == again[k].dtype and torch.equal(t, again[k]), k

    (flat_run, chunked_run), refusal = spawn(_resumes_then_refusal, 2, [base + ["--load", flat], base + [
        "--load", chunked, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]],
        base + ["--load", ckpt], timeout=200)[-1]
    assert ("was saved with --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2; this run uses 1 and 1"
            in refusal and "tools/reshard_checkpoint.py" in refusal), refusal
    for run in (flat_run, chunked_run):
        assert sorted(run["losses"]) == [3, 4]
        for i in (3, 4):
            assert abs(run["losses"][i] - ref["losses"][i]) <= 1e-5 * abs(ref["losses"][i]), (i, run, ref)


def test_layouts_map_layers_both_ways():
    lay = Layout(8, tp=1, pp=2, vp=2)   # stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3
    assert [lay.offset(s, c) for s in range(2) for c in range(2)] == [0, 4, 2, 6]
    for layer in range(8):
        (stage, chunk), local = local_key(f"decoder.layers.{layer}.mlp.linear_fc1.weight", lay)
        assert global_key(local, lay, stage, chunk) == f"decoder.layers.{layer}.mlp.linear_fc1.weight"
    assert local_key("embedding.word_embeddings.weight", lay) == (None, "embedding.word_embeddings.weight")
    emb = "embedding.word_embeddings.weight"
    assert lay.holds(0, 0, emb) and not lay.holds(0, 1, emb)
    assert lay.holds(1, 1, "output_layer.weight") and not lay.holds(1, 0, "decoder.final_layernorm.weight")
    with pytest.raises(ValueError, match=r"must be divisible by --pipeline-model-parallel-size \(3\)"):
        Layout(8, tp=1, pp=3, vp=1)


def test_tp_split_follows_the_layer_classes():
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    # fused SwiGLU fc1: each TP rank holds [its slice of gate; its slice of up]
    shards = [split_tp("decoder.layers.0.mlp.linear_fc1.weight", full, 2, r, swiglu=True) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([full[0:2], full[4:6]]))
    assert torch.equal(merge_tp("decoder.layers.0.mlp.linear_fc1.weight", shards, swiglu=True), full)
    bias = torch.arange(8.0)
    assert torch.equal(split_tp("decoder.layers.0.mlp.linear_fc1.bias", bias, 2, 1, swiglu=True),
                       torch.tensor([2.0, 3.0, 6.0, 7.0]))
    # row-parallel weights split along dim 1, their biases and the norms are replicated
    assert torch.equal(split_tp("decoder.layers.0.self_attention.linear_proj.weight", full, 2, 1, False), full[:, 3:])
    for name in ("decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.input_layernorm.weight",
                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"):
        assert torch.equal(split_tp(name, bias, 2, 1, False), bias)
    # column-parallel and vocab-parallel: dim 0, prefixes (Float16Module's "module.") allowed
    assert torch.equal(split_tp("module.output_layer.weight", full, 4, 3, False), full[6:])
    assert torch.equal(split_tp("module.embedding.word_embeddings.weight", full, 2, 0, False), full[:4])
    with pytest.raises(CheckpointError, match="its copies on the 2 TP ranks differ"):   # not replicated after all
        merge_tp("decoder.layers.0.mlp.linear_fc3.weight", [full, full + 1], swiglu=False)
    with pytest.raises(CheckpointError, match="does not split over TP 3"):
        split_tp("decoder.layers.0.self_attention.linear_qkv.weight", full, 3, 0, False)


def test_tp_needs_whole_query_groups():
    args = {"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 64}
    assert tp_problems(args, 2) == []
    assert tp_problems(args, 4) == ["query groups (--num-query-groups) 2 is not divisible by it"]


def test_padded_vocabulary_is_kept_where_the_new_tp_divides_it():
    args = {"tokenizer_vocab_size": 50257, "padded_vocab_size": 51200, "make_vocab_size_divisible_by": 128}
    rows, div, note = target_vocab(args, 4)   # Megatron-LM's rule would give 50688 at TP 4
    assert rows == 51200 and div == 256 and "resume with --make-vocab-size-divisible-by 256" in note
    assert target_vocab({**args, "padded_vocab_size": 50304}, 1) == (50304, 128, None)   # the rule gives it anyway
    rows, div, note = target_vocab(args, 4, divisible_by=128)
    assert (rows, div) == (50688, 128) and "from 51200 to 50688 rows" in note
    rows, div, note = target_vocab(args, 3)   # 51200 does not split over 3 ranks: padded by the rule
    assert (rows, div) == (50304, 128) and "from 51200 to 50304" in note
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(resize_vocab(t, 2, True), t[:2])
    assert torch.equal(resize_vocab(t, 4, True)[3], t[2]) and torch.equal(resize_vocab(t, 4, False)[3], t[2] * 0)


def test_bad_flags_are_refused_by_name(tmp_path, capsys):
    from megatron_ext.training.checkpoint_reshard import reshard_checkpoint

    (tmp_path / "src").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        reshard_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), 1, 1)
    with pytest.raises(SystemExit):
        _reshard(str(tmp_path / "src"), str(tmp_path / "dst"), 0, 1)
    assert "--target-tensor-parallel-size must be at least 1" in capsys.readouterr().err
