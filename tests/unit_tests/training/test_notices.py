"""The quiet first screen: megatron-core's known fallback notices once, on rank 0; unknown warnings everywhere."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

from megatron_ext.training.notices import KNOWN_NOTICES, is_known_notice, quiet_known_notices

from .conftest import REPO
from .test_pretrain_gpt import _data_flags


def _show_with(rank: int, messages):
    """Warnings shown by the filter on ``rank``: (notice stream, lines the usual machinery printed)."""
    notices, usual = io.StringIO(), []
    saved = warnings.showwarning
    try:
        warnings.showwarning = lambda m, c, f, l, file=None, line=None: usual.append(str(m))
        quiet_known_notices(rank, stream=notices)
        for text in messages:
            warnings.showwarning(UserWarning(text), UserWarning, "x.py", 1)
    finally:
        warnings.showwarning = saved
    return notices.getvalue().splitlines(), usual


def test_known_notices_once_on_rank_0_unknown_on_every_rank():
    known = "Apex is not installed. Falling back to Torch Norm"
    unknown = "something nobody has seen before"
    lines0, usual0 = _show_with(0, [known, known, unknown, known])
    lines1, usual1 = _show_with(1, [known, unknown])
    assert lines0 == [f"> notice (megatron-core): {known}"] and usual0 == [unknown]
    assert lines1 == [] and usual1 == [unknown]
    assert is_known_notice("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
    assert not is_known_notice("Apex is broken")
    # megatron-core's CUDA and Transformer Engine advice (every rank, every TP layer's backward)
    assert is_known_notice("When using async grad allreduce it is recommended to set the environment variable "
                           "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
    assert is_known_notice("If you are using transformer_engine as the transformer implementation, the core_attn is "
                           "from transformer_engine and may be the fused version.")


def test_entry_point_first_screen_is_quiet(text_dataset, tiny_model_flags, tmp_path):
    argv = tiny_model_flags + _data_flags(text_dataset) + ["--global-batch-size", "4", "--train-iters", "2",
                                                           "--log-interval", "1", "--lr-warmup-iters", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          "-m", "megatron_ext.training.pretrain_gpt"] + argv, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    first = next(i for i, l in enumerate(lines) if " iteration " in l)
    screen, in_args = [], False
    for line in lines[:first]:   # the arguments table is Megatron-LM's listing, not noise
        if "arguments ---" in line:
            in_args = not in_args if "end of" not in line else False
            continue
        if not in_args:
            screen.append(line)
    assert len(screen) <= 8, "\n".join(screen)
    for pattern in KNOWN_NOTICES:
        shown = [l for l in screen if pattern in l]
        assert len({l for l in shown}) == len(shown), shown   # each notice once
    escaped = [l for l in lines if any(p in l for p in KNOWN_NOTICES) and not l.startswith("> notice")]
    assert not escaped, escaped   # a known notice printed as a raw warning (by any rank)
