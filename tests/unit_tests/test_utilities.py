"""megatron-core-style ``Utils`` for tests that run inside a spawned gloo world (see dist_harness.py).

Mirrors ``tests/unit_tests/test_utilities.py`` of Megatron-LM so tests read the same, but assumes
torch.distributed is already initialised by the harness (gloo, CPU) and turns on megatron_ext's CPU compat.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Utils:
    """Initialise / destroy megatron-core's parallel_state for a given TP/PP inside the current world."""

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                  virtual_pipeline_model_parallel_size: int | None = None, seed: int = 1234,
                                  **kwargs) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_ext.compat import enable_cpu_compat

        assert dist.is_initialized(), "Utils runs inside a spawned world (tests/unit_tests/dist_harness.py)"
        enable_cpu_compat()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)

    @staticmethod
    def destroy_model_parallel() -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
