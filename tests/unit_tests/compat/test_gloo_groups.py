"""Gloo groups share one transport device per process once the CPU shims are on (compat/gloo_groups.py)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from megatron_ext.compat import gloo_groups


def _loop_threads() -> int:
    """gloo's transport event loops in this process (one per device)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("gloo_tcp_loop")


def _groups_on_one_device():
    import torch.distributed as dist

    from megatron_ext.compat import enable_cpu_compat

    rank = dist.get_rank()
    before = _loop_threads()
    assert enable_cpu_compat()
    pairs = [dist.new_group([0, 1]) for _ in range(4)]
    singles = [dist.new_group([r]) for r in range(2) for _ in range(2)]   # each rank builds every group
    mine = [g for g in singles if dist.get_rank(g) >= 0]
    for g in pairs + mine:
        dist.barrier(group=g)
    # Collectives on two groups at once from two threads (the progress engine's clone beside the training thread's
    # group): one device's loop serves both.
    outs = {}

    def reduce(i: int) -> None:
        x = torch.arange(100_000, dtype=torch.float32) * (rank + 1) + i
        for _ in range(5):
            dist.all_reduce(x, group=pairs[i])
        outs[i] = x

    threads = [threading.Thread(target=reduce, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gathered = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gathered, torch.full((3,), float(rank)), group=pairs[2])
    one = torch.ones(4)
    dist.all_reduce(one, group=mine[0])
    return before, _loop_threads(), [outs[i].tolist()[:3] + outs[i].tolist()[-1:] for i in range(2)], \
        [g.tolist() for g in gathered], one.tolist()


def test_groups_share_one_device_and_reduce_exactly(spawn):
    for before, after, reduced, gathered, one in spawn(_groups_on_one_device, 2,
                                                       env={"MEGATRON_EXT_GLOO_SHARED_DEVICE": "1"}):
        assert (before, after) == (1, 2)   # the world group's device, and one for every group made after
        for i, x in enumerate(reduced):
            # sum over ranks r of (a * (r + 1) + i), doubled by each of the four further all-reduces
            ref = ((torch.arange(100_000, dtype=torch.float32) * 3 + 2 * i) * 2 ** 4).tolist()
            assert x == ref[:3] + ref[-1:]
        assert gathered == [[0.0] * 3, [1.0] * 3]
        assert one == [1.0] * 4   # a group of one rank


def _timeouts_and_recreate():
    """What torch does with gloo backends still works on the shared ones: their type checks (which setting a group's
    timeout goes through), a group's own timeout, and destroying groups and building new ones."""
    import datetime
    import warnings

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megatron_ext.compat import enable_cpu_compat

    assert enable_cpu_compat()
    cpu = torch.device("cpu")
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=77))
    world = c10d._get_default_group()
    checks = [isinstance(x._get_backend(cpu), c10d.ProcessGroupGloo) for x in (world, g)]
    timeouts = [g._get_backend(cpu).options._timeout.total_seconds()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch warns and does nothing when it does not see a gloo backend
        for x in (world, g):
            c10d._set_pg_timeout(datetime.timedelta(seconds=55), x)
    timeouts.append(g._get_backend(cpu).options._timeout.total_seconds())
    dist.destroy_process_group(g)
    h = dist.new_group([0, 1])
    x = torch.full((5,), float(dist.get_rank() + 1))
    dist.all_reduce(x, group=h)
    return checks, timeouts, x.tolist(), _loop_threads()


def test_timeouts_type_checks_and_recreated_groups(spawn):
    for checks, timeouts, reduced, loops in spawn(_timeouts_and_recreate, 2,
                                                  env={"MEGATRON_EXT_GLOO_SHARED_DEVICE": "1"}):
        assert checks == [True, True]
        assert timeouts == [77.0, 55.0]
        assert reduced == [3.0] * 5
        assert loops == 2


class _FakeGloo:
    made: list = []

    @classmethod
    def create_device(cls, interface: str = ""):
        cls.made.append(interface)
        return f"dev:{interface}"

    @classmethod
    def create_default_device(cls):
        cls.made.append("default")
        return "dev:default"


def test_devices_per_process_and_interfaces(monkeypatch):
    monkeypatch.setattr(gloo_groups, "_SHARED", None)
    monkeypatch.setattr(gloo_groups, "_INHERITED", [])
    monkeypatch.setattr(_FakeGloo, "made", [])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,eth1")
    assert gloo_groups._shared_devices(_FakeGloo) == ["dev:eth0", "dev:eth1"]
    assert gloo_groups._shared_devices(_FakeGloo) == ["dev:eth0", "dev:eth1"]
    assert _FakeGloo.made == ["eth0", "eth1"]   # built once per process
    pid = os.getpid()
    monkeypatch.setattr(gloo_groups.os, "getpid", lambda: pid + 1)   # a forked child builds its own
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert gloo_groups._shared_devices(_FakeGloo) == ["dev:default"]
    assert _FakeGloo.made == ["eth0", "eth1", "default"]
    assert gloo_groups._INHERITED[-2:] == ["dev:eth0", "dev:eth1"]   # the parent's, kept, never freed in the child


@pytest.mark.parametrize("value", ["0", "off"])
def test_switched_off(monkeypatch, value):
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setenv("MEGATRON_EXT_GLOO_SHARED_DEVICE", value)
    cls = c10d.ProcessGroupGloo
    assert gloo_groups.patch_gloo_groups() is False
    assert c10d.ProcessGroupGloo is cls
