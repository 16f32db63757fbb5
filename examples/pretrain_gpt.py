#!/usr/bin/env python
"""Megatron-LM-style ``pretrain_gpt.py`` for megatron_ext: launch it with torchrun exactly like Megatron-LM's.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --num-layers 24 --hidden-size 2048 ... \\
        --use-overlapped-distributed-optimizer --overlap-grad-reduce --overlap-param-gather

All flags: ``python examples/pretrain_gpt.py --help``. The implementation is megatron_ext.training.pretrain_gpt.
"""
import sys

from megatron_ext.training.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
