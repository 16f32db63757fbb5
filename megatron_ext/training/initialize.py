"""Process-group, megatron-core parallel state and seed set-up for pretrain_gpt (and its teardown)."""
from __future__ import annotations

import argparse
import datetime
import os
import random

import numpy
import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_minutes: int = 10) -> bool:
    """Join the torchrun world (env:// rendezvous) unless one exists. Returns True if this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:  # plain `python -m ...`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(29500 + os.getpid() % 1000)))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return True


def init_model_parallel(args: argparse.Namespace) -> None:
    """megatron-core parallel_state for TP x PP x DP, the CPU shims when there is no CUDA, and the seeds."""
    from megatron.core import parallel_state as ps

    from megatron_ext.compat import enable_cpu_compat

    enable_cpu_compat()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # (as Megatron-LM: --distributed-timeout-minutes governs the TP/PP/DP groups too, not only the world group)
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                 virtual_pipeline_model_parallel_size=getattr(
                                     args, "virtual_pipeline_model_parallel_size", None),
                                 distributed_timeout_minutes=args.distributed_timeout_minutes)
    set_seeds(args.seed)


def set_seeds(seed: int) -> None:
    """Megatron-LM's scheme: a different seed per pipeline stage, TP-aware streams from megatron-core's tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def collective_device() -> torch.device:
    """Where the tensors of a world-group collective live: the current CUDA device with NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def teardown(created_world: bool) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if created_world and dist.is_initialized():
        dist.destroy_process_group()
