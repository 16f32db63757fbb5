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


def test_tracker_points_at_missing_iteration(tmp_path):
    _fake_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("99")
    with pytest.raises(CheckpointError, match="iteration 99"):
        find_checkpoint(str(tmp_path))


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
