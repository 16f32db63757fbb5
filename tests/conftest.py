import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from unit_tests.dist_harness import run_distributed  # noqa: E402


@pytest.fixture
def spawn():
    """``spawn(fn, world_size, *args, **kwargs)``: run ``fn`` on a fresh gloo world and return per-rank results."""
    return run_distributed


# The files that take longest on 2 cores (cold caches; seconds per file from a `--durations=0` run), started first:
# the two xdist workers take whole files in collection order (`--no-loadscope-reorder`: xdist would otherwise order
# them by their number of tests), so a long file collected late would run alone at the end while the other worker
# idles. kernels/test_native.py is left to the end on purpose: its compiled-path checks compile Inductor graphs that
# kernels/test_compiled.py (first) compiles too, and after it they come from the shared Inductor cache (50 s -> 18 s).
LONGEST_FIRST = ("kernels/test_compiled.py", "comm/test_progress_engine.py", "comm/test_convergence.py",
                 "optimizer/test_sharding_plans.py", "training/test_checkpoint_resume.py",
                 "training/test_checkpoint_import.py", "megatron_lm/test_plugin.py",
                 "optimizer/test_param_sync_and_errors.py", "kernels/test_triton_interpreted.py",
                 "training/test_pretrain_gpt.py", "optimizer/test_zero3.py",
                 "optimizer/test_gpt_megatron.py", "optimizer/test_speculative_step.py", "planner/test_cli.py",
                 "planner/test_volumes_memory.py", "optimizer/test_equivalence.py", "comm/test_trace_gpu_step.py",
                 "optimizer/test_ledger_and_buffers.py", "megatron_lm/test_train_sequence_resume.py",
                 "training/test_notices.py", "training/test_checkpoint_reshard.py",
                 "optimizer/test_dist_checkpoint.py", "training/test_batch_size_rampup.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))
    items.sort(key=rank)   # stable: the order inside a file, and of the other files, stays
