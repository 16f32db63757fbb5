"""How a pretrain_gpt run starts and ends, as Megatron-LM's: the final validation and test evaluation, --finetune,
the early exits (--exit-duration-in-mins, --exit-signal-handler: saved, every rank after the same iteration), a
save that fails on one rank (every rank raises, none waits) and --exit-on-missing-checkpoint."""
from __future__ import annotations

import contextlib
import io
import os

from .test_pretrain_gpt import _data_flags


def _lifecycle_runs(base, root):
    import errno
    import signal

    import torch.distributed as dist

    from megatron_ext.training import checkpointing, loop
    from megatron_ext.training.checkpointing import TRACKER, CheckpointError
    from megatron_ext.training.pretrain_gpt import pretrain

    def tracker(name):
        with open(os.path.join(root, name, TRACKER)) as f:
            return int(f.read())

    out = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["full"] = pretrain(base + ["--save", os.path.join(root, "a")])
    out["full_printed"] = printed.getvalue()
    out["fresh"] = pretrain(base + ["--train-iters", "2"])
    out["finetune"] = pretrain(base + ["--train-iters", "2", "--finetune", "--load", os.path.join(root, "a"),
                                       "--save", os.path.join(root, "b")])
    out["finetune_tracker"] = tracker("b")
    out["finetune_common"] = {k: v for k, v in checkpointing._load(
        os.path.join(root, "b", "iter_0000002", "common.pt")).items() if k.startswith("consumed")}

    # into the finetune run's directory without loading it: a notice, and the save goes beside iteration 2
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["late"] = pretrain(base + ["--exit-duration-in-mins", "1e-9", "--save", os.path.join(root, "b")])
    out["late_printed"] = printed.getvalue()
    out["late_tracker"] = tracker("b")
    out["late_beside"] = sorted(os.listdir(os.path.join(root, "b")))

    # SIGTERM reaches rank 0 only, during iteration 2: both ranks save and stop after iteration 2.
    step, calls = loop.train_step, []

    def signalled_step(*args, **kwargs):
        result = step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    loop.train_step = signalled_step
    try:
        out["signalled"] = pretrain(base + ["--exit-signal-handler", "--save", os.path.join(root, "d")])
    finally:
        loop.train_step = step
    out["signalled_tracker"] = tracker("d")
    out["sigterm_restored"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    # Rank 0 cannot prepare its save directory (a full disk): every rank raises, the previous checkpoint stays.
    remove_stale = checkpointing.remove_stale

    def full_disk(save_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    if dist.get_rank() == 0:
        checkpointing.remove_stale = full_disk
    try:
        pretrain(base + ["--train-iters", "5", "--override-opt_param-scheduler", "--save", os.path.join(root, "a"),
                         "--load", os.path.join(root, "a")])
        out["failed_save"] = "no error"
    except CheckpointError as e:
        out["failed_save"] = str(e)
    finally:
        checkpointing.remove_stale = remove_stale
    out["after_failed_save_tracker"] = tracker("a")

    # --exit-on-missing-checkpoint: --load that is also --save and holds nothing is an error, not a fresh start;
    # the command line's main() prints an error every rank agreed on once, from rank 0, and exits with 2 (a --load
    # that does not exist at all is an argument error: test_arguments)
    from megatron_ext.training.pretrain_gpt import main

    os.makedirs(os.path.join(root, "e"), exist_ok=True)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = main(base + ["--load", os.path.join(root, "e"), "--save", os.path.join(root, "e"),
                          "--exit-on-missing-checkpoint"])
    out["missing"] = (rc, stderr.getvalue())
    # a non-finite gradient norm stops every rank together: one line from rank 0, exit status 1
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = main(base + ["--lr", "1e30", "--min-lr", "1e29", "--clip-grad", "0"])
    out["nan"] = (rc, stderr.getvalue())
    return out


def test_final_evaluation_finetune_early_exits_and_a_failed_save(spawn, text_dataset, tiny_model_flags, tmp_path):
    base = [f for f in tiny_model_flags] + _data_flags(text_dataset)[:-2] + [
        "--split", "80,10,10", "--global-batch-size", "4", "--train-iters", "4", "--eval-iters", "1",
        "--eval-interval", "2"]
    from megatron_ext.training.checkpointing import TRACKER

    per_rank = spawn(_lifecycle_runs, 2, base, str(tmp_path), timeout=300)
    last = per_rank[-1]   # the loss and the evaluations are on the last rank

    # Final evaluation: once on the validation set and once on the test set after the last iteration.
    full = last["full"]
    assert sorted(full["eval"]) == [2, 4] and sorted(full["final_eval"]) == ["test", "validation"], full
    assert "validation loss at iteration 4 on validation set" in last["full_printed"]
    assert "validation loss at iteration 4 on test set" in last["full_printed"]

    # --finetune: the saved weights, then iteration 1 with a fresh schedule and data position.
    fine, fresh = last["finetune"], last["fresh"]
    assert sorted(fine["losses"]) == [1, 2]
    assert fine["losses"][1] < fresh["losses"][1] - 0.1, (fine["losses"], fresh["losses"])   # trained weights
    assert fine["log"][1]["lr"] == fresh["log"][1]["lr"]                                    # warmup from 0 again
    assert last["finetune_tracker"] == 2
    assert last["finetune_common"] == {"consumed_train_samples": 8, "consumed_valid_samples": 4}

    for r, res in enumerate(per_rank):
        # --exit-duration-in-mins: past it at once, so every rank saves and stops after iteration 1.
        assert res["late"]["exited"] and res["late"]["iteration"] == 1 and res["late_tracker"] == 1, (r, res["late"])
        assert "final_eval" not in res["late"]
        assert res["late_beside"] == ["iter_0000001", "iter_0000002", TRACKER], res["late_beside"]
        notice = "> notice: --save " + os.path.join(str(tmp_path), "b") + " already holds checkpoints (latest: 2)"
        assert (notice in res["late_printed"]) == (r == 0), (r, res["late_printed"])
        assert "already holds checkpoints" not in res["full_printed"]
        # --exit-signal-handler: SIGTERM on rank 0 stops both ranks after iteration 2, saved.
        assert res["signalled"]["exited"] and res["signalled"]["iteration"] == 2, (r, res["signalled"])
        assert res["signalled_tracker"] == 2 and res["sigterm_restored"]
        # A save that rank 0 cannot prepare: every rank raises with rank 0's message; iteration 4 stays published.
        assert "No space left on device" in res["failed_save"], (r, res["failed_save"])
        assert r == 0 or "(found by rank 0; nothing was saved)" in res["failed_save"], (r, res["failed_save"])
        assert res["after_failed_save_tracker"] == 4
        rc, printed = res["missing"]
        assert rc == 2 and (printed.count("pretrain_gpt: error: --load") == 1 and "no checkpoint there" in printed
                            if r == 0 else "error" not in printed), (r, res["missing"])
        rc, printed = res["nan"]
        assert rc == 1 and (printed.count("pretrain_gpt: error: the gradient norm is") == 1 and "Traceback" not in
                            printed if r == 0 else "error" not in printed), (r, res["nan"])
