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


def test_connect_failure_while_joining_starts_the_world_again(spawn, tmp_path):
    """See [Note: rendezvous retries]: a dropped gloo socket while joining is retried in a fresh world."""
    fault = tmp_path / "fault"
    assert spawn(_sum_ranks, 2, env={"MX_TEST_JOIN_FAULT": str(fault)}) == [1.0, 1.0]
    assert fault.exists()  # the first world did fail


def test_other_join_errors_fail_at_once(spawn):
    with pytest.raises(DistributedTestError, match="could not join the world(.|\n)*no_such_backend"):
        spawn(_sum_ranks, 2, backend="no_such_backend")
