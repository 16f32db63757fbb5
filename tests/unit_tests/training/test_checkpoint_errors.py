"""--load of a missing or damaged checkpoint fails with a message naming the path and the problem."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ext.training.checkpointing import TRACKER, CheckpointError, find_checkpoint


def _fake_checkpoint(root, iteration=4):
    d = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(os.path.join(d, "mp_rank_00_000"))
    torch.save({"w": torch.zeros(3)}, os.path.join(d, "mp_rank_00_000", "model.pt"))
    files = {"mp_rank_00_000/model.pt": os.path.getsize(os.path.join(d, "mp_rank_00_000", "model.pt"))}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"iteration": iteration, "files": files}, f)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return d


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        find_checkpoint(str(tmp_path / "nope"))


def test_empty_directory_has_no_checkpoint(tmp_path):
    assert find_checkpoint(str(tmp_path)) is None


def test_valid_fake_checkpoint_found(tmp_path):
    assert find_checkpoint(str(tmp_path)) is None
    d = _fake_checkpoint(str(tmp_path))
    assert find_checkpoint(str(tmp_path)) == d


def test_corrupt_tracker(tmp_path):
    _fake_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("garbage")
    with pytest.raises(CheckpointError, match="corrupt tracker"):
        find_checkpoint(str(tmp_path))


def test_tracker_points_at_missing_iteration(tmp_path, capsys):
    """An error naming the complete checkpoints there, without a warning before it that it resumes."""
    _fake_checkpoint(str(tmp_path), iteration=120)
    _fake_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("99")
    with pytest.raises(CheckpointError, match="iteration 99.*iter_0000004, iter_0000120"):
        find_checkpoint(str(tmp_path))
    assert "WARNING" not in capsys.readouterr().out


def test_load_of_one_checkpoint_directory_names_its_parent(tmp_path):
    d = _fake_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=f"one checkpoint's directory.*--load {tmp_path}"):
        find_checkpoint(d)


def test_missing_manifest_means_incomplete(tmp_path):
    d = _fake_checkpoint(str(tmp_path))
    os.unlink(os.path.join(d, "manifest.json"))
    with pytest.raises(CheckpointError, match="incomplete"):
        find_checkpoint(str(tmp_path))


def test_truncated_file(tmp_path):
    d = _fake_checkpoint(str(tmp_path))
    p = os.path.join(d, "mp_rank_00_000", "model.pt")
    with open(p, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="model.pt has 10 bytes"):
        find_checkpoint(str(tmp_path))


def test_missing_file(tmp_path):
    d = _fake_checkpoint(str(tmp_path))
    os.unlink(os.path.join(d, "mp_rank_00_000", "model.pt"))
    with pytest.raises(CheckpointError, match="model.pt is missing"):
        find_checkpoint(str(tmp_path))


# ---- re-saving an existing iteration: a crash between the two renames ----------------------------------------


def _staged(root, iteration, content):
    """A complete ``iter_N.tmp`` (as save_checkpoint leaves it just before publishing) holding ``content``."""
    tmp = os.path.join(root, f"iter_{iteration:07d}.tmp")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "payload.txt"), "w") as f:
        f.write(content)
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump({"iteration": iteration, "files": {"payload.txt": len(content)}}, f)


def _payload(ckpt):
    with open(os.path.join(ckpt, "payload.txt")) as f:
        return f.read()


def test_resave_crash_between_renames_keeps_tracker_target_loadable(tmp_path, monkeypatch):
    from megatron_ext.training.checkpointing import publish_checkpoint, remove_stale

    root = str(tmp_path)
    _staged(root, 4, "first")
    publish_checkpoint(root, 4)
    _staged(root, 4, "second!")
    real_rename = os.rename

    def crash_on_tmp(src, dst):  # the process dies right before moving the new version into place
        if src.endswith(".tmp") and not dst.endswith(".tmp"):
            raise OSError("simulated crash")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_tmp)
    with pytest.raises(OSError, match="simulated crash"):
        publish_checkpoint(root, 4)
    monkeypatch.setattr(os, "rename", real_rename)
    assert (tmp_path / TRACKER).read_text() == "4"
    ckpt = find_checkpoint(root)  # iter_0000004 is gone for now; its previous version is complete
    assert ckpt is not None and _payload(ckpt) == "first"

    # The next save (of another iteration) puts the only copy back in place and removes the crashed .tmp.
    remove_stale(root)
    assert sorted(os.listdir(root)) == ["iter_0000004", TRACKER]
    assert _payload(find_checkpoint(root)) == "first"


def test_resave_replaces_and_next_save_removes_leftovers(tmp_path):
    from megatron_ext.training.checkpointing import publish_checkpoint, remove_stale

    root = str(tmp_path)
    _staged(root, 2, "two")
    publish_checkpoint(root, 2)
    _staged(root, 2, "two again")
    publish_checkpoint(root, 2)
    assert _payload(find_checkpoint(root)) == "two again"
    assert sorted(os.listdir(root)) == ["iter_0000002", TRACKER]
    # leftovers of crashed saves: an unpublished .tmp, a redundant .old, a tracker temp file
    _staged(root, 6, "never published")
    os.makedirs(os.path.join(root, "iter_0000002.old"))
    (tmp_path / (TRACKER + ".tmp")).write_text("6")
    remove_stale(root)
    assert sorted(os.listdir(root)) == ["iter_0000002", TRACKER]
    assert _payload(find_checkpoint(root)) == "two again"


# ---- does a checkpoint fit this run? (checked on every rank before anything is loaded) -------------------------


def test_checkpoint_args_mismatch_names_the_flags():
    import argparse

    from megatron_ext.training.checkpoint_compat import check_checkpoint_args

    saved = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, kv_channels=None,
                 group_query_attention=False, num_query_groups=None, seq_length=64, max_position_embeddings=64,
                 position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                 tokenizer_type="HuggingFaceTokenizer", padded_vocab_size=512, tensor_model_parallel_size=1,
                 pipeline_model_parallel_size=2, ladder_residual=False, desync_residual=None, lr=1e-3)
    same = argparse.Namespace(**{**saved, "kv_channels": 16, "lr": 5e-4})  # 16 = 64 / 4, the default; lr is free
    assert check_checkpoint_args(saved, same) == []
    other = argparse.Namespace(**{**saved, "hidden_size": 32, "swiglu": True, "normalization": "RMSNorm",
                                  "desync_residual": "2x", "padded_vocab_size": 640})
    problems = "; ".join(check_checkpoint_args(saved, other))
    for flag in ("--hidden-size: checkpoint 64, this run 32", "--swiglu", "--normalization", "--desync-residual",
                 "--make-vocab-size-divisible-by", "--kv-channels"):
        assert flag in problems, problems
    assert "--num-layers" not in problems
    # --ladder-residual alone is --ladder-residual-layers set to --num-layers; layers 0 is the standard model
    ladder = dict(saved, ladder_residual=True, ladder_residual_layers=None)
    assert check_checkpoint_args(ladder, argparse.Namespace(**{**ladder, "ladder_residual_layers": 2})) == []
    zero = argparse.Namespace(**{**saved, "ladder_residual": True, "ladder_residual_layers": 0})
    assert check_checkpoint_args(saved, zero) == []
    # a standard checkpoint rewired as a Ladder hybrid (seed 002 section 4.2): refused on resume, free to --finetune
    hybrid = {**saved, "ladder_residual": True, "ladder_residual_layers": 1}
    assert "--ladder-residual" in "; ".join(check_checkpoint_args(saved, argparse.Namespace(**hybrid)))
    assert check_checkpoint_args(saved, argparse.Namespace(**hybrid, finetune=True)) == []
    assert check_checkpoint_args(saved, argparse.Namespace(**{**hybrid, "ffn_hidden_size": 128}, finetune=True)) == [
        "--ffn-hidden-size: checkpoint 256, this run 128"]   # shapes are still compared
    # the numerics: the norm epsilon and, for a rope model, the rotary base and percent; free to --finetune (a larger
    # rotary base extends the context), and a model without rope never reads the rotary ones
    rope = dict(saved, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, norm_epsilon=1e-5)
    longer = {**rope, "rotary_base": 500000, "rotary_percent": 0.5, "norm_epsilon": 1e-6}
    problems = "; ".join(check_checkpoint_args(rope, argparse.Namespace(**longer)))
    for flag in ("--rotary-base: checkpoint 10000, this run 500000", "--rotary-percent", "--norm-epsilon"):
        assert flag in problems, problems
    assert check_checkpoint_args(rope, argparse.Namespace(**longer, finetune=True)) == []
    learned = dict(saved, rotary_base=10000, rotary_percent=1.0)
    assert check_checkpoint_args(learned, argparse.Namespace(**{**learned, "rotary_base": 500000})) == []


def test_scheduler_mismatch_is_an_error_unless_a_side_is_chosen():
    import types

    from megatron_ext.training.checkpoint_compat import check_scheduler_state

    saved = dict(max_lr=2e-3, min_lr=1e-4, lr_warmup_steps=16, lr_decay_steps=40, lr_decay_style="cosine",
                 start_wd=0.01, end_wd=0.01, wd_incr_steps=48, wd_incr_style="constant", num_steps=24)
    run = dict(saved, max_lr=1e-3, lr_warmup_steps=32, start_wd=0.1, end_wd=0.1)
    del run["num_steps"]
    sched = types.SimpleNamespace(override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False, **run)
    problems = check_scheduler_state(saved, sched, saved_gbs=8, gbs=8)
    assert problems == ["--lr: checkpoint 0.002, this run 0.001",
                        "--lr-warmup-iters / --lr-warmup-fraction: checkpoint 16 samples (2 iterations of "
                        "--global-batch-size 8), this run 32 samples (4 iterations of --global-batch-size 8)",
                        "--start-weight-decay (constant style: --weight-decay): checkpoint 0.01, this run 0.1",
                        "--end-weight-decay (constant style: --weight-decay): checkpoint 0.01, this run 0.1"], problems
    # Another global batch size with the same iterations: the sample counts differ, and the message says why.
    same_iters = dict(run, max_lr=saved["max_lr"], lr_warmup_steps=8, lr_decay_steps=20, wd_incr_steps=24,
                      start_wd=0.01, end_wd=0.01)
    problems = check_scheduler_state(saved, types.SimpleNamespace(**{**vars(sched), **same_iters}), saved_gbs=8,
                                     gbs=4)
    assert problems[0] == ("--global-batch-size: checkpoint 8, this run 4 (schedule lengths are counted in "
                           "samples)"), problems
    assert ("--lr-warmup-iters / --lr-warmup-fraction: checkpoint 16 samples (2 iterations of --global-batch-size "
            "8), this run 8 samples (2 iterations of --global-batch-size 4)") in problems, problems
    assert len(problems) == 4, problems   # and the decay and weight-decay lengths
    # A --train-samples run names its own flags, in samples; its batch size is no cause
    problems = check_scheduler_state(saved, types.SimpleNamespace(**{**vars(sched), **same_iters}), saved_gbs=8,
                                     gbs=4, samples=True)
    assert problems[0] == "--lr-warmup-samples / --lr-warmup-fraction: checkpoint 16 samples, this run 8 samples"
    assert "--lr-decay-samples (default --train-samples): checkpoint 40 samples, this run 20 samples" in problems
    assert "--train-samples (the weight-decay schedule length): checkpoint 48 samples, this run 24 samples" in problems
    for side in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        assert check_scheduler_state(saved, types.SimpleNamespace(**{**vars(sched), side: True})) == []



def test_published_checkpoint_without_tracker_is_resumed_not_overwritten(tmp_path, capsys):
    """A save whose tracker write failed after the rename (disk full, a kill) left a complete iter_N: --load finds
    the newest such checkpoint (with a warning) instead of starting from scratch and saving over it."""
    root = str(tmp_path)
    _fake_checkpoint(root, iteration=2)
    newest = _fake_checkpoint(root, iteration=10_000_000)   # 8 digits: past iter_dir_name's 7
    os.makedirs(os.path.join(root, "iter_0000020.tmp"))       # never published: not a candidate
    os.unlink(os.path.join(root, TRACKER))
    assert find_checkpoint(root) == newest
    assert "no latest_checkpointed_iteration.txt" in capsys.readouterr().out
    os.makedirs(os.path.join(root, "iter_0000030"))           # renamed into place without a manifest: not one
    assert find_checkpoint(root) == newest


def test_remove_stale_cleans_leftovers_past_seven_digits(tmp_path):
    from megatron_ext.training.checkpointing import remove_stale

    for name in ("iter_10000000.tmp", "iter_0000005.tmp"):
        os.makedirs(tmp_path / name)
    os.makedirs(tmp_path / "iter_12345678.old")   # the only copy of its iteration: renamed back
    remove_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["iter_12345678"]


@pytest.mark.parametrize("layout", ["torch", "torch_dist", "release"])
def test_megatron_lm_checkpoint_is_named_as_such(tmp_path, layout):
    """Megatron-LM's tracker has our tracker's name; its iteration directories are not damaged checkpoints."""
    name = "release" if layout == "release" else "iter_0000100"
    d = tmp_path / name
    if layout == "torch_dist":
        os.makedirs(d)
        (d / ".metadata").write_bytes(b"")
        (d / "__0_0.distcp").write_bytes(b"")
    else:
        os.makedirs(d / "mp_rank_00")
        torch.save({}, d / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / TRACKER).write_text("release" if layout == "release" else "100")
    with pytest.raises(CheckpointError, match="Megatron-LM"):
        find_checkpoint(str(tmp_path))


def test_newer_complete_checkpoint_than_the_tracker_is_reported(tmp_path, capsys):
    """The tracker wins (a rollback edits it), but a newer published checkpoint is named in a warning."""
    root = str(tmp_path)
    _fake_checkpoint(root, iteration=8)
    older = _fake_checkpoint(root, iteration=4)   # the tracker now names 4
    assert find_checkpoint(root) == older
    out = capsys.readouterr().out
    assert "tracker names iteration 4" in out and "iter_0000008" in out
    (tmp_path / TRACKER).write_text("8")
    assert find_checkpoint(root).endswith("iter_0000008") and "WARNING" not in capsys.readouterr().out


def test_megatron_lm_checkpoint_without_its_tracker_is_named_as_such(tmp_path):
    os.makedirs(tmp_path / "iter_0000100" / "mp_rank_00")
    torch.save({}, tmp_path / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="Megatron-LM"):
        find_checkpoint(str(tmp_path))


def test_wsd_settings_are_saved_and_compared_on_resume():
    """megatron-core's scheduler state leaves WSD's decay length and style out: the checkpoint holds them beside it,
    a resume with other values is an error naming the flag, and --use-checkpoint-opt_param-scheduler takes the
    checkpoint's (with the learning rate recomputed)."""
    import types

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.training.checkpoint_compat import check_scheduler_state, load_scheduler_state, scheduler_state

    def sched(decay_iters, style="linear", use_checkpoint_opt_param_scheduler=False):
        opt = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
                                       lr_decay_steps=80, lr_decay_style="WSD", start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=80, wd_incr_style="constant", wsd_decay_steps=decay_iters * 8,
                                       lr_wsd_decay_style=style,
                                       use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler)

    saved_sched = sched(4)
    saved_sched.step(increment=56)   # iteration 7: 1 of the 4 decay iterations done
    saved = scheduler_state(saved_sched)
    assert saved["wsd_decay_steps"] == 32 and saved["lr_wsd_decay_style"] == "linear"
    assert check_scheduler_state(saved, sched(4), saved_gbs=8, gbs=8) == []
    problems = check_scheduler_state(saved, sched(2, "cosine"), saved_gbs=8, gbs=8)
    assert problems == ["--lr-wsd-decay-iters (WSD): checkpoint 32 samples (4 iterations of --global-batch-size 8), "
                        "this run 16 samples (2 iterations of --global-batch-size 8)",
                        "--lr-wsd-decay-style (WSD): checkpoint 'linear', this run 'cosine'"], problems
    resumed = sched(2, "cosine", use_checkpoint_opt_param_scheduler=True)
    load_scheduler_state(resumed, saved)
    assert (resumed.wsd_decay_steps, resumed.lr_wsd_decay_style) == (32, "linear")
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(saved_sched.optimizer.param_groups[0]["lr"])
    assert saved_sched.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.75)
