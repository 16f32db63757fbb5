#!/usr/bin/env python
"""Import a Megatron-LM checkpoint (``--ckpt-format torch_dist``, its default, or ``torch``) as a pretrain_gpt one.

Reads the iteration that Megatron-LM's tracker in ``--load`` names (or ``--ckpt-step``), offline, on a CPU host.
Publishes it in ``--save`` at the same TP/PP sizes. It carries the weights, the iteration, the consumed samples (the
data position) and the model flags, and the Adam state of Megatron's optimizers (distributed or not) or of the
megatron_ext plug-in: then resume as usual. Chained optimizers and the RNG states are not carried: after
those, continue with ``--no-load-optim`` (fresh Adam moments), or start a fine-tune with ``--finetune``::

    python tools/import_megatron_lm_checkpoint.py --load mlm_ckpt --save ckpt --transformer-impl local
    torchrun --nproc-per-node 8 -m megatron_ext.training.pretrain_gpt ... --load ckpt --no-load-optim --save ckpt

Use ``tools/reshard_checkpoint.py`` on the result for other TP/PP sizes. What is carried and how the layers are named:
``megatron_ext/training/checkpoint_import.py`` (torch) and ``checkpoint_import_dist.py`` (torch_dist).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megatron_ext.training.checkpoint_import import import_megatron_lm_checkpoint
from megatron_ext.training.checkpointing import CheckpointError


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--load", required=True, help="Megatron-LM's checkpoint directory (the one holding "
                   "latest_checkpointed_iteration.txt); only read")
    p.add_argument("--save", required=True, help="directory to publish the pretrain_gpt checkpoint in (not --load)")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="the iteration to import (default: the one the tracker names)")
    p.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="the --transformer-impl of the run that will load it (default: the saving run's); local "
                        "renames Transformer Engine's fused layer-norm weights and drops its extra state")
    p.add_argument("--no-load-optim", action="store_true",
                   help="import the weights alone, leaving the optimizer state (resume with --no-load-optim): for a "
                        "state the import cannot carry")
    args = p.parse_args(argv)
    if args.ckpt_step is not None and args.ckpt_step < 0:
        p.error(f"--ckpt-step must be at least 0, got {args.ckpt_step}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        import_megatron_lm_checkpoint(args.load, args.save, args.transformer_impl, args.ckpt_step,
                                      load_optim=not args.no_load_optim)
    except (CheckpointError, OSError) as e:   # nothing published: the tracker moves only after a complete write
        print(f"import_megatron_lm_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
