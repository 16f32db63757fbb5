"""Batch-size ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``), as Megatron-LM runs it.

megatron-core's ``RampupBatchsizeNumMicroBatchesCalculator`` gives the global batch size at each consumed-sample
count (START, raised by INCREMENT every SAMPLES / ((--global-batch-size - START) / INCREMENT) samples, then
--global-batch-size); the training loop asks it at every iteration, so a resume mid-ramp continues where the
checkpoint's consumed samples put it. The iterations a run takes are Megatron-LM's ``update_train_iters``: the ramp
phase counted step by step, then the remaining samples at the full batch size (a partial last batch is dropped).
"""
from __future__ import annotations

import argparse
from typing import List, Optional


def rampup_calculator(args: argparse.Namespace):
    """megatron-core's calculator for this run, or None without ``--rampup-batch-size``."""
    if args.rampup_batch_size is None:
        return None
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    start, increment, samples = args.rampup_batch_size
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size, decrease_batch_size_if_needed=False, rank=-1,
        start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples)


def global_batch_size_at(calculator, args: argparse.Namespace, consumed_samples: int) -> int:
    """The global batch size of the iteration that starts after ``consumed_samples``."""
    if calculator is None:
        return args.global_batch_size
    calculator.update(consumed_samples, consistency_check=True)
    return calculator.get_current_global_batch_size()


def ramp_sizes(args: argparse.Namespace) -> List[int]:
    """Every global batch size the ramp goes through, START to --global-batch-size."""
    start, increment, _ = args.rampup_batch_size
    return list(range(start, args.global_batch_size + 1, increment))


def rampup_train_iters(args: argparse.Namespace) -> int:
    """Iterations for ``--train-samples`` with the ramp (Megatron-LM's ``update_train_iters``)."""
    calc = rampup_calculator(args)
    ramp = args.rampup_batch_size[2]
    iterations, consumed = 0, 0
    while consumed <= ramp and consumed <= args.train_samples:
        consumed += global_batch_size_at(calc, args, consumed)
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def rampup_problems(args: argparse.Namespace) -> Optional[str]:
    """Why ``--rampup-batch-size`` does not fit this run (None when it does), before megatron-core asserts."""
    start, increment, samples = args.rampup_batch_size
    gbs, per_step = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    if args.train_samples is None:
        return "it needs --train-samples (Megatron-LM ramps sample-based training only)"
    if start <= 0 or increment <= 0 or samples <= 0:
        return f"START ({start}), INCREMENT ({increment}) and SAMPLES ({samples}) must be positive"
    if start >= gbs or (gbs - start) % increment:
        return (f"START ({start}) must be below --global-batch-size ({gbs}) by a multiple of INCREMENT "
                f"({increment})")
    bad = [b for b in ramp_sizes(args) if b % per_step]
    if bad:
        return (f"the batch sizes {bad} of the ramp are not multiples of --micro-batch-size "
                f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})")
    return None
