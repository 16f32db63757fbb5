#!/usr/bin/env python
"""Rewrite a pretrain_gpt checkpoint for other tensor/pipeline-parallel sizes (Megatron-LM's
``tools/checkpoint/convert.py`` for megatron_ext checkpoints).

Reads the checkpoint the tracker of ``--load`` names (checksums verified) and publishes the same iteration in
``--save`` for ``--target-tensor-parallel-size`` x ``--target-pipeline-parallel-size``: weights, optimizer state
(master weights and moments), LR schedule, iteration and data position. One process, no GPU, no process group; the
source is only read. Resume it with the new sizes and any DP size::

    python tools/reshard_checkpoint.py --load ckpt --save ckpt_tp1pp2 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2
    torchrun --nproc-per-node 4 -m megatron_ext.training.pretrain_gpt ... \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --load ckpt_tp1pp2 --save ckpt_tp1pp2

The target keeps the checkpoint's pipeline split (even, or Megatron-LM's uneven ``--decoder-first/last-pipeline-num-
layers`` / ``--account-for-embedding/loss-in-pipeline-split``) unless the ``--target-...`` split flags give another
(``--target-even-pipeline-split``: the even one). RNG states are not carried over (they are per rank): the resumed run
re-seeds from ``--seed``. ``--target-transformer-impl local`` renames Transformer Engine's layer names for a run
without it. How each tensor is split: ``megatron_ext/training/checkpoint_reshard.py`` ([Note: reshard
rules]).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megatron_ext.training.checkpoint_reshard import reshard_checkpoint
from megatron_ext.training.checkpointing import CheckpointError
from megatron_ext.training.pipeline_layout import LAYOUT_ARGS


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory (the one holding "
                   "latest_checkpointed_iteration.txt); only read")
    p.add_argument("--save", required=True, help="directory to publish the resharded checkpoint in (not --load)")
    p.add_argument("--target-tensor-parallel-size", type=int, required=True)
    p.add_argument("--target-pipeline-parallel-size", type=int, required=True)
    p.add_argument("--target-num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline stage (interleaved schedule); default: the checkpoint's")
    split = p.add_argument_group("target pipeline split (default: the checkpoint's; megatron-core's rule, see "
                                 "megatron_ext/training/pipeline_layout.py)")
    split.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None)
    split.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None)
    split.add_argument("--target-account-for-embedding-in-pipeline-split", action="store_true")
    split.add_argument("--target-account-for-loss-in-pipeline-split", action="store_true")
    split.add_argument("--target-even-pipeline-split", action="store_true",
                       help="split the layers evenly over the target stages (none of the four above)")
    p.add_argument("--target-make-vocab-size-divisible-by", type=int, default=None,
                   help="pad the vocabulary to a multiple of this x the target TP (Megatron-LM's rule; padding rows "
                        "are cut or added, which moves the loss); default: keep the checkpoint's padded size when "
                        "the target TP divides it (the notice names the flag to resume with)")
    p.add_argument("--target-transformer-impl", choices=("local",), default=None,
                   help="rename Transformer Engine's fused layer-norm weights to megatron-core's local names (and "
                        "drop its extra states), for a run with --transformer-impl local; default: the checkpoint's")
    args = p.parse_args(argv)
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_num_virtual_stages_per_pipeline_rank", "target_make_vocab_size_divisible_by",
                 "target_decoder_first_pipeline_num_layers", "target_decoder_last_pipeline_num_layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    given = {k: getattr(args, f"target_{k}") for k in LAYOUT_ARGS}
    some = any(v is not None and v is not False for v in given.values())   # (a layer count of 0 is refused above)
    if args.target_even_pipeline_split and some:
        p.error("--target-even-pipeline-split conflicts with the other --target-... pipeline split flags")
    # the target's split: as given (the even split with --target-even-pipeline-split), else the checkpoint's
    args.split = given if args.target_even_pipeline_split or some else None
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        reshard_checkpoint(args.load, args.save, args.target_tensor_parallel_size,
                           args.target_pipeline_parallel_size, args.target_num_virtual_stages_per_pipeline_rank,
                           args.target_make_vocab_size_divisible_by, split=args.split,
                           transformer_impl=args.target_transformer_impl)
    except CheckpointError as e:
        print(f"reshard_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
