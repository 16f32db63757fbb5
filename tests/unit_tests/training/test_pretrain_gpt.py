"""End-to-end pretrain_gpt on CPU gloo worlds: TP x DP and PP x DP on preprocess_data output, loss falling."""
from __future__ import annotations

import math
import os
import sys

import pytest


def _train(argv):
    from megatron_ext.training.pretrain_gpt import pretrain

    return pretrain(argv)


def _data_flags(text_dataset):
    prefix, tok = text_dataset
    return ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok,
            "--split", "90,10,0"]


def test_loss_decreases_tp2xdp2(spawn, text_dataset, tiny_model_flags):
    """(PP x DP: test_interleaved_pipeline_trains_like_one_chunk_per_stage.)"""
    argv = tiny_model_flags + _data_flags(text_dataset) + ["--tensor-model-parallel-size", "2"] + [
        "--global-batch-size", "8", "--train-iters", "8", "--eval-iters", "1", "--eval-interval", "8",
        "--ranks-per-node", "2"]
    results = spawn(_train, 4, argv, timeout=200)
    last = results[-1]  # the last rank is on the last pipeline stage and holds the loss
    losses = [last["losses"][i] for i in sorted(last["losses"])]
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    assert 8 in last["eval"]


def _runs(argvs):
    from megatron_ext.training.pretrain_gpt import pretrain

    return [pretrain(argv) for argv in argvs]


def _other_text_dataset(tmp_path, tok):
    """A second corpus (stdlib files the training corpus leaves out), tokenized with the same tokenizer."""
    import json
    import sysconfig

    from .conftest import REPO

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import preprocess_data

    jsonl = tmp_path / "other.jsonl"
    with open(jsonl, "w") as f:
        for name in ("random.py", "pprint.py"):
            with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as src:
                text = src.read()
            for i in range(0, len(text), 8000):
                f.write(json.dumps({"text": text[i:i + 8000]}) + "\n")
    prefix = str(tmp_path / "other")
    assert preprocess_data.main(["--input", str(jsonl), "--output-prefix", prefix, "--tokenizer-type",
                                 "HuggingFaceTokenizer", "--tokenizer-model", tok, "--append-eod"]) == 0
    return prefix + "_text_document"


def test_per_split_data_paths_read_each_split_whole(spawn, text_dataset, tiny_model_flags, tmp_path):
    """--train-data-path P trains on the samples --data-path P --split 100,0,0 gives (megatron-core's
    blend_per_split: the whole file for its split), bit for bit; --valid-data-path V is what is evaluated: the
    same training with V or with P as the validation file logs other validation losses."""
    prefix, tok = text_dataset
    other = _other_text_dataset(tmp_path, tok)
    common = tiny_model_flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok,
                                 "--global-batch-size", "8", "--train-iters", "3"]
    per_split = common + ["--train-data-path", prefix, "--eval-iters", "1", "--eval-interval", "3"]
    blend, on_other, on_train = spawn(_runs, 2, [
        common + ["--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0"],
        per_split + ["--valid-data-path", other], per_split + ["--valid-data-path", prefix]], timeout=200)[-1]
    assert on_other["losses"] == on_train["losses"] == blend["losses"] and len(blend["losses"]) == 3
    assert 3 in on_other["eval"] and not blend["eval"]
    assert on_other["eval"][3] != on_train["eval"][3], (on_other["eval"], on_train["eval"])


def _layout_free_init(module):
    """Re-initialise a built stage chunk from each parameter's *global* name (layer numbers as in the full model),
    so that any pipeline layout of the same GPT starts from the same weights (megatron-core's initialisation draws
    from one stream per stage, in the order the stage builds its layers). The tied output layer takes the word
    embedding's values, as megatron-core's set-up copies them."""
    import re
    import zlib

    import torch

    inner = getattr(module, "module", module)   # (Float16Module under --fp16/--bf16)
    layers = dict(inner.decoder.layers.named_children())
    for name, p in inner.named_parameters():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        key = f"layer{layers[m[1]].layer_number}.{m[2]}" if m else name
        if name == "output_layer.weight" and inner.share_embeddings_and_output_weights:
            key = "embedding.word_embeddings.weight"
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        value = torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1)
        with torch.no_grad():
            p.copy_(value + 1.0 if p.dim() == 1 and name.endswith("weight") else value)   # norms' weights near 1
    return module


def _runs_from_one_init(argvs):
    import megatron_ext.training.model as model_mod
    from megatron_ext.training.pretrain_gpt import pretrain

    from megatron_ext.training.checkpointing import CheckpointError

    def run(argv):
        try:
            return pretrain(argv)
        except CheckpointError as e:
            return str(e)

    build = model_mod.build_model
    model_mod.build_model = lambda args, vp_stage=None: _layout_free_init(build(args, vp_stage))
    try:
        return [run(a) for a in argvs]
    finally:
        model_mod.build_model = build


def test_interleaved_pipeline_trains_like_one_chunk_per_stage(spawn, text_dataset, tiny_model_flags, tmp_path):
    """PP 2 x DP 2 with two model chunks per stage (stage 0 holds layers 1 and 3, stage 1 layers 2 and 4; the
    interleaved schedule, one ODO over both chunks; 4 micro-batches per step, so its steady state runs: with 2 it
    never did, and hid gloo sends of freed memory) trains like PP 2 x DP 2 with one chunk per stage from the same
    weights; a checkpoint saved halfway resumes under ZeRO-3 (which gathers per chunk) to the same losses, and a
    resume with another chunk count is refused by name."""
    ckpt = str(tmp_path / "ckpt")
    base = tiny_model_flags[2:] + _data_flags(text_dataset) + [
        "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters", "4",
        "--eval-iters", "1", "--eval-interval", "4", "--ranks-per-node", "2"]
    vpp = base + ["--num-layers-per-virtual-pipeline-stage", "1"]
    tb_dir = str(tmp_path / "tb")
    runs = spawn(_runs_from_one_init, 4, [base + ["--tensorboard-dir", tb_dir],
                                          vpp + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"],
                                          vpp + ["--load", ckpt, "--param-shard-size", "2"], base + ["--load", ckpt],
                                          vpp + ["--fp16", "--initial-loss-scale", "4194304", "--hysteresis", "1"]],
                 timeout=300)
    plain, first, resumed, refused, fp16 = runs[-1]   # the last rank is on the last stage and holds the losses
    assert sorted(first["losses"]) == [1, 2] and sorted(resumed["losses"]) == [3, 4]
    # Bit for bit: each layer computes and reduces the same sums in the same order; only the buckets differ (one
    # set per chunk), and the grad norm and Adam work element by element or in fixed-order sums over them.
    assert {**first["losses"], **resumed["losses"]} == plain["losses"], (first, resumed, plain)
    assert resumed["eval"] == plain["eval"] and list(plain["eval"]) == [4]
    assert plain["losses"][4] < plain["losses"][1] - 0.1, plain["losses"]   # and it learns
    # --tensorboard-dir: the last rank's events hold what the log lines printed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_dir).Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["lm loss"] == sorted(plain["losses"].items()), scalars["lm loss"]
    # as Megatron-LM: the in-loop evaluation, then the final one, under one tag
    final = plain["final_eval"]
    assert scalars["lm loss validation"] == [(4, plain["eval"][4]), (4, final["validation"])], scalars
    assert "test" not in final and "lm loss test" not in scalars   # (--split 90,10,0: no test set)
    assert {"learning-rate", "grad-norm", "bytes-per-step/intra-node"} <= set(scalars), set(scalars)
    # fp16 (a Float16Module per chunk): the first steps overflow and are skipped while the scale falls; the memory
    # line waits for the first applied one, when Adam's states exist
    assert [fp16["log"][i]["skipped"] for i in (1, 2, 3, 4)] == [1, 1, 1, 0], fp16["log"]
    assert fp16["memory"]["optimizer_states"] == first["memory"]["optimizer_states"], (fp16["memory"], first["memory"])
    # before any applied update, the fp16 forward of the initial weights is within fp16 rounding of fp32's
    assert abs(fp16["losses"][1] - plain["losses"][1]) < 0.01, (fp16["losses"], plain["losses"])
    # the memory line adds up the chunks (each holds its own optimizer states; the padding of the buckets differs)
    for part in ("parameters", "optimizer_states"):
        assert abs(first["memory"][part] / plain["memory"][part] - 1) < 0.05, (part, first["memory"], plain["memory"])
    assert all(r[3] == refused for r in runs), [r[3] for r in runs]
    assert ("the model chunks per pipeline stage (--num-virtual-stages-per-pipeline-rank or "
            "--num-layers-per-virtual-pipeline-stage): checkpoint 2, this run 1") in refused, refused


def _first_losses(argvs):
    from megatron_ext.training.pretrain_gpt import pretrain

    return [pretrain(a)["losses"].get(1) for a in argvs]


def test_ladder_residual_tp2_first_loss_equals_tp1(spawn, text_dataset, tiny_model_flags):
    """--ladder-residual through pretrain_gpt: with CPU initialisation, TP=2 starts exactly where TP=1 does."""
    base = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "4", "--train-iters", "2",
                                                           "--ladder-residual"]
    tp1, tp2 = spawn(_first_losses, 2, [base, base + ["--tensor-model-parallel-size", "2"]], timeout=120)[-1]
    assert abs(tp1 - tp2) < 1e-5 * abs(tp1), (tp1, tp2)


def _default_corpus_runs(argvs, cache_dir):
    """pretrain_gpt without --data-path, on a small default corpus (the real builder, fewer stdlib bytes than the
    demo's 6 MB so the test stays fast), recording the Ladder/Desync options each built GPT received."""
    import megatron_ext.training.corpus as corpus
    import megatron_ext.training.model as model_mod
    from megatron_ext.training.pretrain_gpt import pretrain

    build_corpus, build_model = corpus.build_default_corpus, model_mod.build_model
    corpus.build_default_corpus = lambda: build_corpus(cache_dir, vocab_size=300, max_bytes=150_000)
    built = []

    def recording_build_model(args):
        module = build_model(args)
        lad = module.ladder
        built.append((lad.ladder, lad.ladder_layers, lad.desync, lad.num_ladder_layers(args.num_layers)))
        return module

    model_mod.build_model = recording_build_model
    return [(pretrain(a)["losses"], built[-1]) for a in argvs]


def test_default_corpus_with_desync_and_partial_ladder(spawn, tiny_model_flags, tmp_path):
    base = tiny_model_flags + ["--tensor-model-parallel-size", "2", "--global-batch-size", "2", "--train-iters", "2"]
    runs = spawn(_default_corpus_runs, 2, [base + ["--desync-residual", "2x"],
                                           base + ["--ladder-residual", "--ladder-residual-layers", "1"]],
                 str(tmp_path / "cache"), timeout=150)[-1]
    (desync_losses, desync), (ladder_losses, ladder) = runs
    assert desync == (False, None, "2x", 0) and ladder == (True, 1, None, 1)
    for losses in (desync_losses, ladder_losses):
        assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    assert os.listdir(tmp_path / "cache")[0].startswith("stdlib-corpus-")


def _recompute_runs(argvs):
    """Each run's losses and how many times its layers and core attentions ran forward (recomputation runs them
    again in backward)."""
    import megatron_ext.training.model as model_mod
    from megatron_ext.training.pretrain_gpt import pretrain

    build = model_mod.build_model
    out = []
    for argv in argvs:
        calls = {"layer": 0, "core_attention": 0}

        def counted(args, calls=calls):
            model = build(args)
            for name, m in model.named_modules():
                kind = type(m).__name__
                if kind == "TransformerLayer" or name.endswith("core_attention"):
                    key = "layer" if kind == "TransformerLayer" else "core_attention"
                    m.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
            return model

        model_mod.build_model = counted
        try:
            result = pretrain(argv)
            out.append((result["losses"], dict(calls), result["memory"]))
        finally:
            model_mod.build_model = build
    return out


def test_recompute_trains_exactly_like_no_recompute(spawn, text_dataset, tiny_model_flags):
    """--recompute-activations (selective: core attention) and --recompute-granularity full (uniform, block; also
    with ZeRO-3, whose weights are gathered again for the recomputed forward) give the same losses bit for bit as
    no recomputation, and recompute what they say."""
    base = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "4", "--train-iters", "3"]
    full = ["--recompute-granularity", "full", "--recompute-num-layers", "1", "--recompute-method"]
    zero3 = ["--param-shard-size", "2"]
    variants = [[], ["--recompute-activations"], full + ["uniform"], full + ["block"], zero3, zero3 + full + ["uniform"]]
    runs = spawn(_recompute_runs, 2, [base + v for v in variants], timeout=240)[0]
    memory = [r[2] for r in runs]
    (plain, plain_calls), (sel, sel_calls), (uni, uni_calls), (blk, blk_calls), (z3, z3_calls), (z3r, z3r_calls) = [
        r[:2] for r in runs]
    # the measured model-state report (printed after the first logged iteration): ZeRO-3 at DP 2 holds half the
    # weights of ZeRO-1 (both pad buckets to 2 equal shards), the same optimizer states, and recomputation no other
    assert memory[0]["parameters"] == 2 * memory[4]["parameters"] > 0, memory
    assert memory[0]["optimizer_states"] == memory[4]["optimizer_states"] > 0, memory
    assert memory[1] == memory[0] and memory[5]["parameters"] == memory[4]["parameters"], memory
    assert sel == plain and uni == plain and blk == plain, (plain, sel, uni, blk)
    assert z3r == z3 and abs(z3[3] - plain[3]) < 1e-5 * plain[3], (z3, z3r, plain)
    # 3 iterations x 1 micro-batch x 2 layers forward (no evaluation): recomputation runs them again.
    assert plain_calls == {"layer": 6, "core_attention": 6} == z3_calls, plain_calls
    assert sel_calls == {"layer": 6, "core_attention": 12}, sel_calls
    assert uni_calls["layer"] == 12 and blk_calls["layer"] == 9 and z3r_calls["layer"] == 12, (uni_calls, blk_calls)


def _runs_with_stats(argvs):
    """Each run's losses, grad norms and its speculative rounds (committed, rolled back)."""
    from megatron_ext.optimizer import speculative_step
    from megatron_ext.training.pretrain_gpt import pretrain

    out, seen = [], []
    init = speculative_step.SpeculativeStep.__init__

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        seen.append(self)

    speculative_step.SpeculativeStep.__init__ = recording_init
    try:
        for argv in argvs:
            seen.clear()
            res = pretrain(argv)
            out.append((res["losses"], res.get("grad_norms"),
                        (sum(s.committed for s in seen), sum(s.rolled_back for s in seen))))
    finally:
        speculative_step.SpeculativeStep.__init__ = init
    return out


def test_speculative_step_trains_exactly_like_the_usual_step(spawn, text_dataset, tiny_model_flags):
    """--odo-speculative-step through pretrain_gpt, 2 DP ranks on 2 simulated nodes, 2 micro-batches per step: the
    same losses bit for bit as without it, with --clip-grad 0 (every round commits) and with a clip every step
    exceeds (every round rolls back)."""
    base = tiny_model_flags + _data_flags(text_dataset) + [
        "--global-batch-size", "8", "--train-iters", "3", "--ranks-per-node", "1", "--grad-reduce", "qgz"]
    spec = ["--odo-speculative-step"]
    variants = [["--clip-grad", "0"], ["--clip-grad", "0"] + spec, ["--clip-grad", "1e-4"],
                ["--clip-grad", "1e-4"] + spec]
    (usual0, _, r0), (spec0, _, r1), (usual1, _, r2), (spec1, _, r3) = spawn(
        _runs_with_stats, 2, [base + v for v in variants], timeout=240)[0]
    assert spec0 == usual0 and spec1 == usual1, (usual0, spec0, usual1, spec1)
    assert usual0 != usual1   # the clip bites
    assert r0 == r2 == (0, 0) and r1 == (3, 0) and r3 == (0, 3), (r0, r1, r2, r3)
