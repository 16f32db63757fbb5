"""Run a Megatron-LM checkout's own ``pretrain_gpt.py`` with the plug-in, without editing it.

    torchrun --nproc-per-node 8 -m megatron_ext.megatron_lm.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron-LM flags> --use-overlapped-distributed-optimizer [--grad-reduce qgz ...]

It does what the two added lines would do (see plugin.py): ``install()`` and chaining :func:`add_args` into the
``extra_args_provider`` the script passes to ``megatron.training.pretrain``, then runs the script as ``__main__``.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
from typing import List, Optional

from .plugin import chain, install


def patch_pretrain() -> None:
    """Make ``megatron.training.pretrain`` add this project's flags to whatever extra_args_provider it is given."""
    training_pkg = importlib.import_module("megatron.training")
    training_mod = importlib.import_module("megatron.training.training")
    original = training_mod.pretrain
    if getattr(original, "_megatron_ext", False):
        return

    def pretrain(*args, **kwargs):
        kwargs["extra_args_provider"] = chain(kwargs.get("extra_args_provider"))
        return original(*args, **kwargs)

    pretrain._megatron_ext = True  # type: ignore[attr-defined]
    training_mod.pretrain = pretrain
    training_pkg.pretrain = pretrain


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m megatron_ext.megatron_lm.launch /path/to/Megatron-LM/pretrain_gpt.py "
                         "[flags]")
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_ext.megatron_lm.launch: {argv[0]}: no such file")
    sys.path.insert(0, os.path.dirname(script))  # the checkout root, so `import megatron.training` resolves there
    from megatron_ext.training.notices import quiet_known_notices

    quiet_known_notices()   # megatron-core's fallback notices once, on rank 0 (before the checkout imports it)
    install()
    patch_pretrain()
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
