import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from unit_tests.dist_harness import run_distributed  # noqa: E402


@pytest.fixture
def spawn():
    """``spawn(fn, world_size, *args, **kwargs)``: run ``fn`` on a fresh gloo world and return per-rank results."""
    return run_distributed


# The files that take longest on 2 cores (cold caches), started first: the two xdist workers take whole files in
# collection order, so a long file collected late would run alone at the end while the other worker idles.
LONGEST_FIRST = ("comm/test_convergence.py", "kernels/test_compiled.py", "comm/test_progress_engine.py",
                 "training/test_checkpoint_resume.py", "kernels/test_native.py", "kernels/test_triton_interpreted.py",
                 "optimizer/test_sharding_plans.py", "optimizer/test_speculative_step.py",
                 "optimizer/test_param_sync_and_errors.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))
    items.sort(key=rank)   # stable: the order inside a file, and of the other files, stays
