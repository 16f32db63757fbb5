"""Autograd functions for the TP reductions of Ladder and Desynced residual blocks.

[Note: forward]  ``LadderReduce`` launches an async all-reduce of a row-parallel module's partial output and
returns the buffer at once; ``PendingOutput.wait()`` (called one module later) waits and then adds the bias and
applies dropout *in place*, so the bias is added exactly once, after the reduction. Backward is the identity on
the partial output (megatron's reduce-from-TP region): every rank's partial sum receives the full gradient.

[Note: backward overlap]  In a ladder, module k's backward needs the reduced gradient of the residual after
module k+2's input, not k+1's. With ``backward_overlap`` the residual-stream gradient is kept as per-rank partial
sums (column-parallel layers skip their input-grad all-reduce), and ``LadderAdd`` (the add of out_k into the
residual, executed in forward just before module k+2) launches the all-reduce of that gradient asynchronously in
backward. ``GradRendezvous`` sits right after ``LadderReduce`` at the end of module k; autograd runs it after
module k+1's backward (lower sequence number), so the reduction overlaps module k+1's backward, mirroring the
forward. Replicated parameters on the partial path (norm weights; desync: row-parallel biases) have their
gradients summed by one ``sum_grads_over_tp`` node per layer (ladder_block.py, [Note: deferred parameter
gradients]); the block's output gradient is divided by TP to enter partial form, and its input gradient is summed
by the first layer's node to leave it.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist


# Optional event log for tests: (event, module tag) in execution order, e.g. ("grad_launch", 3).
TRACE: Optional[List[Tuple[str, Any]]] = None


def _trace(event: str, tag: Any) -> None:
    if TRACE is not None:
        TRACE.append((event, tag))


class _Slot:
    """Holds the buffer and work handle of one in-flight gradient all-reduce."""

    __slots__ = ("buf", "work", "tag")

    def __init__(self, tag: Any = None) -> None:
        self.buf: Optional[torch.Tensor] = None
        self.work = None
        self.tag = tag

    def wait(self) -> torch.Tensor:
        _trace("grad_wait", self.tag)
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buf


class PendingOutput:
    """A module output whose TP all-reduce may still be in flight; ``wait()`` returns it finished."""

    def __init__(self, tensor: torch.Tensor, work, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                 buf: torch.Tensor) -> None:
        self.tensor, self._work, self._bias, self._mask, self._buf = tensor, work, bias, mask, buf

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            with torch.no_grad():
                if self._bias is not None:
                    self._buf.add_(self._bias.detach())
                if self._mask is not None:
                    self._buf.mul_(self._mask)
            self._bias = self._mask = None
        return self.tensor


class _LadderReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                group, holder: list, tag: Any = None) -> torch.Tensor:
        ctx.tag = tag
        out = partial.contiguous()
        work = dist.all_reduce(out, group=group, async_op=True) if dist.get_world_size(group) > 1 else None
        holder.append(work)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _trace("module_backward", ctx.tag)
        (mask,) = ctx.saved_tensors
        if mask is not None:
            grad = grad * mask
        gbias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad, gbias, None, None, None, None


def launch_ladder_reduce(partial: torch.Tensor, bias: Optional[torch.Tensor], group, dropout_p: float,
                         training: bool, tag: Any = None) -> PendingOutput:
    """Start the all-reduce of ``partial``; bias and dropout are applied after it finishes (in ``wait``)."""
    mask = None
    if training and dropout_p > 0:
        keep = torch.empty_like(partial).bernoulli_(1.0 - dropout_p)
        mask = keep / (1.0 - dropout_p)
    holder: list = []
    out = _LadderReduce.apply(partial, bias, mask, group, holder, tag)
    buf = _storage_alias(out)
    if holder[0] is None:  # TP=1: nothing in flight, finish now
        with torch.no_grad():
            if bias is not None:
                buf.add_(bias.detach())
            if mask is not None:
                buf.mul_(mask)
        return PendingOutput(out, None, None, None, buf)
    return PendingOutput(out, holder[0], bias, mask, buf)


def _storage_alias(t: torch.Tensor) -> torch.Tensor:
    """Alias of ``t``'s memory with its own version counter: finishing the reduction in place (bias, dropout)
    must not look like an in-place edit of the autograd output; nothing saved it for backward before then."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                               t.size(), t.stride())


class _GradRendezvous(torch.autograd.Function):
    """Identity forward; backward waits for the gradient all-reduce that ``LadderAdd`` launched."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slot: _Slot) -> torch.Tensor:
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.slot.wait(), None


class _LadderAdd(torch.autograd.Function):
    """``r + out``; backward launches the async all-reduce of out's (partial) gradient into the slot."""

    @staticmethod
    def forward(ctx, r: torch.Tensor, out: torch.Tensor, slot: _Slot, group) -> torch.Tensor:
        ctx.slot, ctx.group = slot, group
        return r + out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _trace("grad_launch", ctx.slot.tag)
        buf = grad.clone()
        ctx.slot.buf = buf
        ctx.slot.work = dist.all_reduce(buf, group=ctx.group, async_op=True)
        return grad, buf, None, None


def rendezvous(x: torch.Tensor, tag: Any = None) -> Tuple[torch.Tensor, _Slot]:
    slot = _Slot(tag)
    return _GradRendezvous.apply(x, slot), slot


def ladder_add(r: torch.Tensor, out: torch.Tensor, slot: Optional[_Slot], group) -> torch.Tensor:
    if slot is None:
        return r + out
    return _LadderAdd.apply(r, out, slot, group)


class _SyncAllReduce(torch.autograd.Function):
    """All-reduce forward *and* backward: the summed value feeds rank-specific (desynced) computations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sync_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return _SyncAllReduce.apply(x, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; gradient multiplied by ``scale`` (replicated -> partial form with 1/TP)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class _SumGradsOverTP(torch.autograd.Function):
    """Identity forward for several tensors; backward sums all their gradients over TP in ONE all-reduce
    (a layer's norm weights and biases together: small tensors, so the cost is latency, paid once per layer)."""

    @staticmethod
    def forward(ctx, group, *xs: torch.Tensor):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        return (None, *[f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])


def sum_grads_over_tp(xs: List[Optional[torch.Tensor]], group) -> List[Optional[torch.Tensor]]:
    present = [x for x in xs if x is not None]
    if not present or dist.get_world_size(group) == 1:
        return list(xs)
    out = iter(_SumGradsOverTP.apply(group, *present))
    return [next(out) if x is not None else None for x in xs]


def sum_grad_over_tp(x: Optional[torch.Tensor], group) -> Optional[torch.Tensor]:
    """Identity forward, all-reduce backward (like megatron's copy-to-TP region) for replicated params/inputs.

    Unlike megatron's version the backward reduces a copy: autograd hands the *same* gradient tensor to both
    inputs of an add (``r + out``), so an in-place all-reduce would also change the gradient of ``r``.
    """
    if x is None or dist.get_world_size(group) == 1:
        return x
    return _SumGradsOverTP.apply(group, x)[0]
