"""The commands tools/megatron_lm_check.sh would run, from its dry run (MX_CHECK_DRY_RUN=1: no GPU, nothing runs)."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from ..tool_loader import TOOLS

SCRIPT = TOOLS / "megatron_lm_check.sh"


def dry_runs(checkout: Path, out: Path, iters: int = 40) -> list[tuple[str, list[str]]]:
    """(name, arguments after the training script) of every run, in order."""
    env = dict(os.environ, MX_CHECK_DRY_RUN="1", MX_CHECK_ITERS=str(iters))
    proc = subprocess.run(["bash", str(SCRIPT), str(checkout), str(out)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = []
    for line in proc.stdout.splitlines():
        if line.startswith("RUN "):
            name, *argv = shlex.split(line[len("RUN "):])
            # the training script (or pretrain_gpt's module: the last run continues in this package)
            script = next(i for i, a in enumerate(argv)
                          if a.endswith(".py") or a == "megatron_ext.training.pretrain_gpt")
            runs.append((name, argv[script + 1:]))
    return runs
