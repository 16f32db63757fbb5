import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from unit_tests.dist_harness import run_distributed  # noqa: E402


@pytest.fixture
def spawn():
    """``spawn(fn, world_size, *args, **kwargs)``: run ``fn`` on a fresh gloo world and return per-rank results."""
    return run_distributed
