import pytest
import torch
import torch.distributed as dist

from unit_tests.dist_harness import DistributedTestError


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank_two_fails():
    if dist.get_rank() == 2:
        raise ValueError("boom on rank two")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the other ranks would hang here without the harness
    return 0


@pytest.mark.parametrize("world", [2, 3, 8])
def test_world_runs_collectives(spawn, world):
    assert spawn(_sum_ranks, world) == [float(sum(range(world)))] * world


def test_failure_on_one_rank_is_reported_without_hang(spawn):
    with pytest.raises(DistributedTestError, match="rank 2 failed(.|\n)*boom on rank two"):
        spawn(_rank_two_fails, 4, timeout=120)
