"""Record what the communication library is actually asked to do: every ``torch.distributed.all_reduce`` call
(size, async or not) and every wait on its handle, interleaved with module forward events.

The recorder wraps the real collective (results unchanged), so a schedule test sees the waits that really happen,
not what the code under test says about itself.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

import torch
import torch.distributed as dist

Event = Tuple[Any, ...]


class _LoggedWork:
    def __init__(self, work, index: int, log: List[Event]) -> None:
        self._work, self._index, self._log = work, index, log

    def wait(self, *args: Any, **kwargs: Any):
        self._log.append(("wait", self._index))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


@contextlib.contextmanager
def record_all_reduces(log: List[Event]) -> Iterator[None]:
    """Append ``("launch", i, numel, async_op)`` per all-reduce and ``("wait", i)`` when its handle is waited
    (a blocking all-reduce is launched and waited at once)."""
    real = dist.all_reduce
    count = [0]

    def recorded(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        i = count[0]
        count[0] += 1
        log.append(("launch", i, tensor.numel(), async_op))
        work = real(tensor, op=op, group=group, async_op=async_op)
        if not async_op:
            log.append(("wait", i))
            return work
        return _LoggedWork(work, i, log)

    dist.all_reduce = recorded
    try:
        yield
    finally:
        dist.all_reduce = real


def hook_modules(modules: List[torch.nn.Module], log: List[Event]) -> List[Any]:
    """Log ``("pre", m)`` / ``("post", m)`` around the forward of ``modules[m]``; returns the hook handles."""
    handles = []
    for m, mod in enumerate(modules):
        handles.append(mod.register_forward_pre_hook(lambda *_, m=m: log.append(("pre", m))))
        handles.append(mod.register_forward_hook(lambda *_, m=m: log.append(("post", m))))
    return handles
