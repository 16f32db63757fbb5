"""Checkpoints: exact resume at the same DP size, resharding DP 4 -> 2, and a crash mid-save."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch.distributed as dist

from .test_pretrain_gpt import _data_flags


def _runs(argv_list):
    """Several pretrain_gpt runs one after another in the same world (each sets up and tears down its state)."""
    from megatron_ext.training.pretrain_gpt import pretrain

    return [pretrain(argv) for argv in argv_list]


def _ordered(losses):
    return [losses[i] for i in sorted(losses)]


def test_exact_resume_same_dp(spawn, text_dataset, tiny_model_flags, tmp_path):
    base = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "8", "--train-iters", "8",
                                                           "--hidden-dropout", "0.1"]
    ckpt = str(tmp_path / "ckpt")
    straight = base
    first = base + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "4"]
    second = base + ["--load", ckpt]
    # --ckpt-step: an earlier iteration than the tracker's, as Megatron-LM; one that was not saved is named
    earlier = base + ["--load", ckpt, "--ckpt-step", "2", "--exit-interval", "4"]
    a, b, c, d = spawn(_runs, 2, [straight, first, second, earlier], timeout=200)[-1]
    assert sorted(b["losses"]) == list(range(1, 5)) and sorted(c["losses"]) == list(range(5, 9))
    resumed = {**b["losses"], **c["losses"]}
    assert _ordered(resumed) == _ordered(a["losses"])  # bit-identical, iteration by iteration
    assert d["losses"] == {i: a["losses"][i] for i in (3, 4)}
    missing = spawn(_load_error, 2, base + ["--load", ckpt, "--ckpt-step", "3"])[0]
    assert ("--ckpt-step asks for iteration 3 but" in missing
            and "iter_0000002, iter_0000004; pass one of them as --ckpt-step)" in missing), missing


def test_skip_train_evaluates_the_loaded_weights_as_the_run_that_saved_them(spawn, text_dataset, tiny_model_flags,
                                                                           tmp_path):
    """--skip-train (Megatron-LM's evaluation-only run): the checkpoint's weights, evaluated from the saved validation
    position, give the saving run's final validation and test losses bit for bit; nothing is trained or saved."""
    base = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "8", "--train-iters", "2",
                                                           "--eval-iters", "1", "--eval-interval", "1",
                                                           "--split", "80,10,10"]
    ckpt = str(tmp_path / "ckpt")
    trained, evaluated = spawn(_runs, 2, [base + ["--save", ckpt, "--save-interval", "2"],
                                          base + ["--load", ckpt, "--skip-train"]], timeout=200)[-1]
    assert set(trained["final_eval"]) == {"validation", "test"}
    assert evaluated["final_eval"] == trained["final_eval"] and evaluated["iteration"] == 2
    assert evaluated["losses"] == {}
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_reshard_dp4_to_dp2_other_bucket_size_and_backends(spawn, text_dataset, tiny_model_flags, tmp_path):
    base = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "8", "--train-iters", "8"]
    ckpt = str(tmp_path / "ckpt")
    # DP=4 straight run that also saves at iteration 4 (and 8); resume the iteration-4 checkpoint at DP=2.
    ref = spawn(_runs, 4, [base + ["--save", ckpt, "--save-interval", "4"]], timeout=200)[-1][0]
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")
    # DP=2 with another bucket size; then with other backends (qgZ INT8 gradients, qwZ weights) on 2 "nodes".
    other = ["--ddp-bucket-size", "3000"]
    quant = ["--grad-reduce", "qgz", "--qgz-bits", "8", "--param-gather", "qwz", "--quant-group-size", "256",
             "--ranks-per-node", "1"]
    resumed, requant = spawn(_runs, 2, [base + ["--load", ckpt] + other, base + ["--load", ckpt] + quant],
                             timeout=200)[-1]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8] and sorted(requant["losses"]) == [5, 6, 7, 8]
    for i in range(5, 9):
        assert abs(resumed["losses"][i] - ref["losses"][i]) < 1e-4 * abs(ref["losses"][i]), (i, resumed, ref)
        assert abs(requant["losses"][i] - ref["losses"][i]) < 2e-2 * abs(ref["losses"][i]), (i, requant, ref)


def test_crash_mid_save_keeps_previous_checkpoint(spawn, text_dataset, tiny_model_flags, tmp_path):
    import pytest

    from unit_tests.dist_harness import DistributedTestError

    ckpt = str(tmp_path / "ckpt")
    argv = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "4", "--train-iters", "4",
                                                           "--save", ckpt, "--save-interval", "2"]
    # Rank 1 dies (os._exit) after writing its files for iteration 4, before the checkpoint is published.
    with pytest.raises(DistributedTestError):  # rank 1 exits; rank 0 fails in the publish collective
        spawn(_runs, 2, [argv], timeout=120, env={"MEGATRON_EXT_TEST_CRASH_IN_SAVE": "1:4"})
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))

    i = argv.index("--train-iters")
    longer = argv[:i + 1] + ["5"] + argv[i + 2:]
    resumed, weights_only = spawn(_runs, 2, [argv + ["--load", ckpt],
                                             longer + ["--load", ckpt, "--no-load-optim"]], timeout=120)[-1]
    assert sorted(resumed["losses"]) == [3, 4]
    assert sorted(weights_only["losses"]) == [5]  # model weights and data position loaded, optimizer fresh
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "5"
    assert os.path.isdir(os.path.join(ckpt, "iter_0000004")) and os.path.isdir(os.path.join(ckpt, "iter_0000005"))
    assert not any(name.endswith(".tmp") for name in os.listdir(ckpt))


def _main_exit(argv):
    """pretrain_gpt's entry point on this rank: its exit code and what it wrote to stderr."""
    import contextlib
    import io

    from megatron_ext.training.pretrain_gpt import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_load_without_a_checkpoint_is_a_clear_error(spawn, text_dataset, tiny_model_flags, tmp_path):
    """An existing --load directory with no checkpoint in it (a missing one is an argument error: test_arguments):
    the entry point exits 2 with one line naming it, found before the data and the model are built."""
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "4", "--train-iters", "2",
                                                           "--load", str(empty)]
    code, err = spawn(_main_exit, 1, argv, timeout=120)[0]
    assert code == 2, err
    assert err == f"pretrain_gpt: error: --load {empty}: no checkpoint there (no latest_checkpointed_iteration.txt; " \
                  "a save that did not finish leaves none)\n", err


@pytest.fixture(scope="module")
def two_step_checkpoint(text_dataset, tmp_path_factory):
    """(flags, pristine checkpoint directory): a 2-iteration DP 2 run's checkpoint, trained once for the tests that
    damage a copy of it."""
    from unit_tests.dist_harness import run_distributed   # (the module the spawn fixture uses: one forkserver)
    from .conftest import _tiny_model_flags

    base = _tiny_model_flags() + _data_flags(text_dataset) + ["--global-batch-size", "4", "--train-iters", "2"]
    ckpt = str(tmp_path_factory.mktemp("two_step") / "ckpt")
    run_distributed(_runs, 2, [base + ["--save", ckpt]], timeout=120)
    return base, ckpt


def _copy_of(two_step_checkpoint, tmp_path):
    base, pristine = two_step_checkpoint
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(pristine, ckpt)
    return base, ckpt


def test_load_corrupt_file_fails_on_every_rank(spawn, two_step_checkpoint, tmp_path):
    """A damaged model file (right size, garbage bytes) is a clear error on all ranks, not a hang."""
    base, ckpt = _copy_of(two_step_checkpoint, tmp_path)
    p = os.path.join(ckpt, "iter_0000002", "mp_rank_00_000", "model.pt")
    size = os.path.getsize(p)
    with open(p, "wb") as f:
        f.write(b"\0" * size)
    errs = spawn(_load_error, 2, base + ["--load", ckpt], timeout=120)
    assert all("corrupt checkpoint file" in e and "model.pt" in e for e in errs), errs


def _load_error(argv):
    from megatron_ext.training.checkpointing import CheckpointError
    from megatron_ext.training.pretrain_gpt import pretrain

    try:
        pretrain(argv)
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_save_syncs_params_and_step_bytes_exclude_eval_and_save(spawn, text_dataset, tiny_model_flags, tmp_path):
    """With --overlap-param-gather the step ends with the qwZ all-gather in flight, and qwZ writes the gathered
    weights only when it is waited for: a save that did not force the param sync would store stale shards, and a
    --no-load-optim resume (weights from model.pt) would then not continue where the straight run does. The straight
    run also evaluates and saves every iteration: the bytes-per-step of its log lines stay the same."""
    qwz = ["--param-gather", "qwz", "--quant-group-size", "256", "--ranks-per-node", "1"]
    base = tiny_model_flags + _data_flags(text_dataset) + qwz + ["--global-batch-size", "4", "--train-iters", "3",
                                                                 "--lr-decay-iters", "10"]
    straight = base + ["--eval-interval", "1", "--eval-iters", "1", "--save", str(tmp_path / "a"),
                       "--save-interval", "1"]
    first = base + ["--save", str(tmp_path / "b"), "--no-save-optim", "--exit-interval", "2"]
    second = base + ["--load", str(tmp_path / "b"), "--no-load-optim"]
    a, b, c = spawn(_runs, 2, [straight, first, second], timeout=200)[-1]
    assert sorted(b["losses"]) == [1, 2] and sorted(c["losses"]) == [3]
    assert c["losses"][3] == a["losses"][3]  # the saved weights are the synced (dequantized) ones, bit for bit
    per_step = {(v["intra_bytes"], v["inter_bytes"]) for v in a["log"].values()}
    assert len(a["log"]) == 3 and len(per_step) == 1 and sum(per_step.pop()) > 0, a["log"]


def _load_errors(base, ckpt):
    """Save at PP=2, then load with another optimizer, another --ffn-hidden-size, and a model file whose last-stage
    tensor has another shape; each load must fail on both stages with the same clear error."""
    import json

    import torch
    import torch.distributed as dist

    from megatron_ext.training.pretrain_gpt import pretrain

    pretrain(base + ["--save", ckpt])
    errors = [_load_error(base + ["--load", ckpt, "--optimizer", "sgd"]),
              _load_error(base + ["--load", ckpt, "--ffn-hidden-size", "128"])]
    if dist.get_rank() == 0:
        d = os.path.join(ckpt, "iter_0000001")
        path = os.path.join(d, "mp_rank_00_001", "model.pt")
        state = torch.load(path, weights_only=False)
        w = state[TAMPERED]
        state[TAMPERED] = torch.zeros(w.shape[0] + 1, *w.shape[1:], dtype=w.dtype)
        torch.save(state, path)
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        manifest["files"]["mp_rank_00_001/model.pt"] = os.path.getsize(path)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(manifest, f)
    dist.barrier()
    errors.append(_load_error(base + ["--load", ckpt]))
    return errors


TAMPERED = "decoder.layers.0.mlp.linear_fc1.weight"


def test_load_errors_are_agreed_by_every_stage(spawn, text_dataset, tiny_model_flags, tmp_path):
    base = tiny_model_flags + _data_flags(text_dataset) + ["--pipeline-model-parallel-size", "2",
                                                           "--global-batch-size", "2", "--train-iters", "1",
                                                           "--lr-warmup-iters", "0"]
    results = spawn(_load_errors, 2, base, str(tmp_path / "ckpt"), timeout=150)
    for rank, (optim, args, model) in enumerate(results):
        assert "--optimizer" in optim and "--no-load-optim" in optim, (rank, optim)
        assert "--ffn-hidden-size: checkpoint 256, this run 128" in args, (rank, args)
        assert f"{TAMPERED}: checkpoint shape (257, 64), this model (256, 64)" in model, (rank, model)
    assert "found by rank 1" in results[0][2]  # stage 0's own files were fine; it fails with stage 1's reason


def _agree(per_rank, check="agree_on_error"):
    """Rank body: run ``checkpointing.<check>`` with this rank's value; the CheckpointError message, or None."""
    import torch.distributed as dist

    from megatron_ext.training import checkpointing

    try:
        getattr(checkpointing, check)(per_rank[dist.get_rank()])
    except checkpointing.CheckpointError as e:
        return str(e)
    return None


def test_one_rank_failing_stops_every_rank(spawn):
    """The agreement behind --load (finding and loading): no rank goes on while a peer has given up."""
    assert spawn(_agree, 2, [None, None], timeout=60) == [None, None]
    ok_rank, failed_rank = spawn(_agree, 2, [None, "--load /x: the tracker names iteration 4 but ... is missing"],
                                 timeout=60)
    assert failed_rank == "--load /x: the tracker names iteration 4 but ... is missing"
    assert ok_rank == failed_rank + " (found by rank 1; no rank loaded anything)"


def test_ranks_that_see_different_checkpoints_all_stop(spawn):
    """One rank sees no tracker (or an older one) while its peers resume: every rank raises, none loads."""
    assert spawn(_agree, 2, ["/c/iter_0000004", "/c/iter_0000004"], "agree_on_checkpoint", timeout=60) == [None, None]
    assert spawn(_agree, 2, [None, None], "agree_on_checkpoint", timeout=60) == [None, None]
    for names in (["/c/iter_0000004", None], ["/c/iter_0000004", "/c/iter_0000002"]):
        errors = spawn(_agree, 2, names, "agree_on_checkpoint", timeout=60)
        assert errors[0] == errors[1] and "ranks see different checkpoints in --load" in errors[0], errors


def _flip_middle_byte(path: str) -> None:
    """XOR one bit of the file's middle byte (twice restores it)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _flip_each_file(argv, ckpt):
    """For every file of the checkpoint: flip one byte, load (every rank must fail naming it), restore it."""
    from megatron_ext.training.checkpointing import CheckpointError
    from megatron_ext.training.pretrain_gpt import pretrain

    with open(os.path.join(ckpt, "manifest.json")) as f:
        files = sorted(json.load(f)["files"])
    out = {}
    for rel in files:
        p = os.path.join(ckpt, rel)
        if dist.get_rank() == 0:
            _flip_middle_byte(p)
        dist.barrier()
        try:
            pretrain(argv)
            out[rel] = "no error"
        except CheckpointError as e:
            out[rel] = str(e)
        dist.barrier()
        if dist.get_rank() == 0:
            _flip_middle_byte(p)
        dist.barrier()
    out["clean"] = pretrain(argv)
    return out


def test_flipped_byte_in_any_file_fails_every_rank_naming_it(spawn, two_step_checkpoint, tmp_path):
    base, ckpt = _copy_of(two_step_checkpoint, tmp_path)
    it = os.path.join(ckpt, "iter_0000002")
    with open(os.path.join(it, "manifest.json")) as f:
        manifest = json.load(f)["files"]
    assert all(isinstance(e, dict) and "crc32" in e for e in manifest.values()), manifest
    assert {"common.pt", "mp_rank_00_000/model.pt", "mp_rank_00_000/optim.pt"} <= set(manifest)
    load = base + ["--load", ckpt, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler"]
    per_rank = spawn(_flip_each_file, 2, load, it, timeout=300)
    for res in per_rank:
        for rel in manifest:
            assert "CRC-32" in res[rel] and rel in res[rel], (rel, res[rel])
        assert sorted(res["clean"]["losses"]) == [3]   # the restored checkpoint loads and training goes on
    # The cost tool reads the same checkpoint: every .pt file, the sizes the manifest recorded.
    from ..tool_loader import loaded_tool

    with loaded_tool("checkpoint_checksum_cost") as tool:
        cost = tool.measure(it, repeat=1)
    assert {r["file"] for r in cost["files"]} == set(manifest)
    assert cost["total"]["bytes"] == sum(e["size"] for e in manifest.values())


def test_zero3_resumes_exactly(spawn, text_dataset, tiny_model_flags, tmp_path):
    """ZeRO-3 + hpZ through pretrain_gpt: save mid-run (the weights gathered for model.pt are released again),
    resume (the load checks read names and shapes of released weights), same losses as the uninterrupted run."""
    base = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "8", "--train-iters", "6",
                                                           "--param-shard-size", "2", "--hpz-partition-size", "2",
                                                           "--eval-interval", "3", "--eval-iters", "1"]
    ckpt = str(tmp_path / "ckpt")
    straight = base
    first = base + ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"]
    second = base + ["--load", ckpt]
    a, b, c = spawn(_runs, 2, [straight, first, second], timeout=200)[-1]
    assert sorted(c["losses"]) == [4, 5, 6]
    assert _ordered({**b["losses"], **c["losses"]}) == _ordered(a["losses"])


def _load_with_io_error(argv):
    """Rank 1 cannot read common.pt (checked before the model is built), then any other file (its share of the
    checksums, while loading): each time every rank raises the same error."""
    import megatron_ext.training.checkpointing as ck
    from megatron_ext.training.pretrain_gpt import pretrain

    intact, errors = ck.file_crc32, []
    for unreadable in (lambda path: path.endswith("common.pt"), lambda path: not path.endswith("common.pt")):
        def broken(path, chunk=1 << 22):
            if dist.get_rank() == 1 and unreadable(path):
                raise OSError(5, "Input/output error", path)
            return intact(path, chunk)
        ck.file_crc32 = broken
        try:
            pretrain(argv)
            errors.append("no error")
        except ck.CheckpointError as e:
            errors.append(str(e))
    ck.file_crc32 = intact
    return errors


def test_io_error_in_checksum_check_fails_every_rank(spawn, two_step_checkpoint, tmp_path):
    base, ckpt = _copy_of(two_step_checkpoint, tmp_path)
    early, loading = zip(*spawn(_load_with_io_error, 2, base + ["--load", ckpt], timeout=120))
    assert all("OSError while looking for the checkpoint" in e and "common.pt" in e for e in early), early
    assert all("OSError while checking the checksums" in e for e in loading), loading
