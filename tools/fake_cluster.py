"""An emulated multi-node link for one GPU: torch.distributed's collectives on torch's fake process group
(``torch.testing._internal.distributed.fake_pg``) replaced by stream-ordered delays, so a multi-rank job's CUDA
paths (streams, events, kernels) run in one process, timed as if the bytes crossed a link.

Each collective behaves as NCCL's does towards the caller's streams: it runs on its own stream per process group,
after waiting for the caller's current stream; it occupies that stream for ``bytes on the wire / link rate``
(``torch.cuda._sleep``, calibrated by :func:`sleep_cycles_per_second`), at ``link_gbit`` for a group that spans
nodes and ``intra_gbit`` inside a node (0: no delay); its ``wait()`` makes the caller's current stream wait for it
and its future is complete at once (NCCL marks it complete at enqueue), so nothing blocks the host. It writes what
every rank holding the same data would receive (reduce-scatter: P x this rank's chunk, ...), so the numerics stay
finite and a training step runs as in a real job. On CPU tensors the data are written at once (a plumbing check).
Used by ``tools/trace_gpu_step.py``.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
import torch.distributed as dist


class LinkWork:
    """A collective's handle as NCCL's behaves towards streams: ``wait()`` orders the caller's current stream after
    it; the future is complete at enqueue."""

    def __init__(self, event) -> None:
        self._event = event

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream(torch.cuda.current_device()).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class EmulatedLink:
    """Replaces torch.distributed's collectives by delays on a per-group stream plus a data-preserving fill."""

    def __init__(self, ranks_per_node: int, link_gbit: float, intra_gbit: float, cycles_per_s: float) -> None:
        self.ranks_per_node = ranks_per_node
        self.link_gbit = link_gbit
        self.intra_gbit = intra_gbit
        self.cycles_per_s = cycles_per_s
        self._groups: Dict[int, Tuple[int, int, float, object]] = {}   # id -> (size, rank, Gbit/s, stream)
        self.wire_bytes = 0
        self.calls = 0

    def install(self) -> None:
        methods = {"reduce_scatter_tensor": self._reduce_scatter, "reduce_scatter_single": self._reduce_scatter,
                   "all_gather_into_tensor": self._all_gather, "all_gather_single": self._all_gather,
                   "all_to_all_single": self._all_to_all, "all_reduce": self._all_reduce,
                   "broadcast": self._broadcast, "reduce": self._reduce, "scatter": self._scatter}
        for name, method in methods.items():
            if hasattr(dist, name):
                setattr(dist, name, method)

    # each collective: (tensors it reads and writes, bytes this rank puts on the wire, the fill)
    def _reduce_scatter(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        size, me, _, _ = self._group(group)
        return self._run(group, async_op, [output, input], input.numel() * input.element_size() * (size - 1) // size,
                         lambda: output.copy_(input.view(size, -1)[me]).mul_(_sum_factor(op, size)))

    def _all_gather(self, output, input, group=None, async_op=False):
        size, _, _, _ = self._group(group)
        return self._run(group, async_op, [output, input], output.numel() * output.element_size() * (size - 1) // size,
                         lambda: output.view(size, -1).copy_(input.reshape(1, -1).expand(size, -1)))

    def _all_to_all(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                    async_op=False):
        size, _, _, _ = self._group(group)
        return self._run(group, async_op, [output, input], input.numel() * input.element_size() * (size - 1) // size,
                         lambda: output.copy_(input.view_as(output)))

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        size, _, _, _ = self._group(group)
        return self._run(group, async_op, [tensor], 2 * tensor.numel() * tensor.element_size() * (size - 1) // size,
                         lambda: tensor.mul_(_sum_factor(op, size)))

    def _reduce(self, tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
        size, _, _, _ = self._group(group)
        return self._run(group, async_op, [tensor], tensor.numel() * tensor.element_size(),
                         lambda: tensor.mul_(_sum_factor(op, size)))

    def _broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        return self._run(group, async_op, [tensor], tensor.numel() * tensor.element_size(), lambda: None)

    def _scatter(self, tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
        size, me, _, _ = self._group(group)
        fill = (lambda: tensor.copy_(scatter_list[me])) if scatter_list else (lambda: None)
        return self._run(group, async_op, [tensor] + list(scatter_list or []),
                         tensor.numel() * tensor.element_size() * (size - 1), fill)

    def _run(self, group, async_op: bool, tensors: Sequence[torch.Tensor], wire_bytes: int, fill):
        self.calls += 1
        self.wire_bytes += wire_bytes
        if not tensors[0].is_cuda:      # CPU plumbing check: no streams, data filled at once
            fill()
            work = LinkWork(None)
            return work if async_op else None
        _, _, gbit, stream = self._group(group)
        # index-based stream calls: the device-object forms cost several microseconds each of host time that a
        # real NCCL launch does not pay
        caller = torch.cuda.current_stream(torch.cuda.current_device())
        stream.wait_stream(caller)
        torch.cuda.set_stream(stream)
        try:
            if gbit > 0:
                torch.cuda._sleep(max(1, int(wire_bytes * 8 / (gbit * 1e9) * self.cycles_per_s)))
            fill()
            event = torch.cuda.Event()
            event.record(stream)
        finally:
            torch.cuda.set_stream(caller)
        for t in tensors:
            t.record_stream(stream)
        work = LinkWork(event)
        if async_op:
            return work
        work.wait()
        return None

    def _group(self, group) -> Tuple[int, int, float, object]:
        """(size, this rank's index, link rate, stream) of a group, looked up once: the emulation must not add host
        time of its own per collective (``dist.get_rank(group)`` alone costs tens of microseconds)."""
        group = group if group is not None else dist.group.WORLD
        info = self._groups.get(id(group))
        if info is None:
            nodes = {r // self.ranks_per_node for r in dist.get_process_group_ranks(group)}
            info = (dist.get_world_size(group), dist.get_rank(group),
                    self.link_gbit if len(nodes) > 1 else self.intra_gbit,
                    torch.cuda.Stream() if torch.cuda.is_available() else None)
            self._groups[id(group)] = info
        return info


def _sum_factor(op, size: int) -> int:
    """What a sum over ``size`` ranks holding the same data multiplies by (an int: integer flags stay integers)."""
    return size if op == dist.ReduceOp.SUM else 1


def sleep_cycles_per_second() -> float:
    """``torch.cuda._sleep`` spins a number of GPU clock cycles: how many make a second on this GPU, now."""
    torch.cuda._sleep(100_000_000)      # let the clock ramp up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 200_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)
