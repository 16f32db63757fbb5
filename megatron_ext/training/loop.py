"""The training and evaluation loop: megatron-core schedules driving the OverlappedDDP + ODO.

One iteration is Megatron-LM's ``train_step``: zero the grad buffers, run ``get_forward_backward_func()`` over
``num_micro_batches`` micro-batches (the schedule calls ``model.no_sync`` for all but the last micro-batch, scales
the loss through ``optimizer.scale_loss`` and finishes with ``finalize_model_grads``, which waits for the ODO's
reduce-scatters), then ``optimizer.step()`` and the LR scheduler. Logging happens on the last rank (the last
pipeline stage, which owns the loss), like Megatron-LM's ``print_rank_last``.

``model`` is, as in Megatron-LM, the list of this stage's model chunks (OverlappedDDP-wrapped): one, or one per
virtual stage with the interleaved pipeline, whose schedule then takes one data iterator per chunk.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import time
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_ext.optimizer.param_groups import logged_lr

from .batch_size import global_batch_size_at, rampup_calculator
from .logging_utils import (TensorBoard, format_eval_line, format_memory_line, format_train_line,
                            num_floating_point_operations)


def print_rank_last(msg: str) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


def print_rank_0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Token-mean cross entropy of one micro-batch (the schedule divides by the number of micro-batches)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator[Dict[str, torch.Tensor]], model: torch.nn.Module
                 ) -> Tuple[torch.Tensor, Callable]:
    """``forward_step_func`` for megatron-core's schedules on GPTDataset batches."""
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _mean_lm_loss(losses: List[Dict[str, torch.Tensor]]) -> Optional[torch.Tensor]:
    """This DP group's average lm loss on the last stage; None on other stages (they see no loss)."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage():
        return None
    local = torch.stack([x["lm loss"].float().reshape(()) for x in losses]).mean()
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    return local / ps.get_data_parallel_world_size()


def train_step(args: argparse.Namespace, fb: Callable, model: Sequence, optimizer, scheduler,
               data_iterator, global_batch_size: int) -> Tuple[Optional[float], bool, Optional[float], Optional[int]]:
    """One iteration of ``global_batch_size`` samples (below --global-batch-size during a ramp-up); returns ``(lm
    loss or None, update applied, grad norm, zeros in the gradient)`` (the zeros under --log-num-zeros-in-grad
    only)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = fb(forward_step_func=forward_step, data_iterator=data_iterator, model=list(model),
                num_microbatches=global_batch_size // (args.micro_batch_size * args.data_parallel_size),
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.seq_length, forward_only=False)
    ok, grad_norm, num_zeros = optimizer.step()
    if ok:
        scheduler.step(increment=global_batch_size)
    loss = _mean_lm_loss(losses)
    return ((None if loss is None else loss.item()), bool(ok), (None if grad_norm is None else float(grad_norm)),
            num_zeros)


@torch.no_grad()
def evaluate(args: argparse.Namespace, fb: Callable, model: Sequence, optimizer, data_iterator) -> Optional[float]:
    """Average lm loss over ``--eval-iters`` global batches of the validation set, on fresh weights (the gathers in
    flight complete; ZeRO-3 gathers as the forward goes, never the whole model at once)."""
    for chunk in model:
        chunk.start_param_sync(force_sync=True)
        chunk.eval()
    total, n = 0.0, 0
    try:
        for _ in range(args.eval_iters):
            losses = fb(forward_step_func=forward_step, data_iterator=data_iterator, model=list(model),
                        num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                        forward_only=True)
            loss = _mean_lm_loss(losses)
            if loss is not None:
                total += loss.item()
                n += 1
    finally:
        for chunk in model:
            chunk.train()
    return total / n if n else None


def evaluate_and_print(args: argparse.Namespace, fb: Callable, model: Sequence, optimizer, data_iterator,
                       iteration: int, prefix: str, tb: TensorBoard, tb_key: str) -> Optional[float]:
    """One evaluation (Megatron-LM's ``evaluate_and_print_results``): its traffic kept out of the step's bytes, the
    validation-loss line on the last rank and the TensorBoard scalar ``tb_key``."""
    with ledger_paused(model):
        loss = evaluate(args, fb, model, optimizer, data_iterator)
    if loss is not None:
        print_rank_last(format_eval_line(prefix, {"lm loss": loss}))
        tb.scalars(iteration, {tb_key: loss})
    return loss


class IntervalStats:
    """What a log line averages over: losses, time, skipped/nan counts since the last line.

    Like Megatron-LM's ``training_log``, the lm loss averages only iterations whose update was applied: an
    iteration skipped for an fp16 overflow counts as skipped (and as nan if its loss was not finite), not in the
    average.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.iters = 0
        self.loss_sum = 0.0
        self.loss_n = 0
        self.skipped = 0
        self.nan = 0
        self.grad_norm: Optional[float] = None
        self.samples = 0
        self.t0 = time.perf_counter()

    def add(self, loss: Optional[float], applied: bool, grad_norm: Optional[float], samples: int = 0) -> None:
        """One iteration of ``samples`` samples: ``loss`` is None off the last pipeline stage; ``applied`` is False
        for a skipped step."""
        self.iters += 1
        self.samples += samples
        if not applied:
            self.skipped += 1
        if loss is not None:
            if not math.isfinite(loss):
                self.nan += 1
            elif applied:
                self.loss_sum += loss
                self.loss_n += 1
        if grad_norm is not None:
            self.grad_norm = grad_norm

    @property
    def lm_loss(self) -> Optional[float]:
        return self.loss_sum / self.loss_n if self.loss_n else None


@contextlib.contextmanager
def ledger_paused(model: Sequence) -> Iterator[None]:
    """Keep evaluation and checkpoint traffic out of the per-step bytes of the training log (every chunk's)."""
    was = [chunk.ledger.enabled for chunk in model]
    for chunk in model:
        chunk.ledger.enabled = False
    try:
        yield
    finally:
        for chunk, enabled in zip(model, was):
            chunk.ledger.enabled = enabled


class ExitSignal:
    """``--exit-signal-handler``: records that SIGTERM (Slurm's warning before a job's time limit) arrived, so that
    the loop saves and exits after the iteration in progress (a signal during set-up: after the first iteration, as
    Megatron-LM); restores the previous handler on exit."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum, self.received, self._previous = signum, False, None

    def __enter__(self) -> "ExitSignal":
        self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        # None: the previous handler was not installed from Python; the default is the closest to it
        signal.signal(self.signum, signal.SIG_DFL if self._previous is None else self._previous)

    def _handle(self, signum, frame) -> None:
        self.received = True


def exit_requested(args: argparse.Namespace, start_time: float, exit_signal: Optional[ExitSignal]) -> Optional[str]:
    """The flag that asks to stop now, decided by all ranks together (one MAX all-reduce per iteration, as in
    Megatron-LM, so that every rank stops after the same iteration): ``--exit-duration-in-mins`` once any rank has
    run past it, ``--exit-signal-handler`` once any rank received the signal. None: go on."""
    duration = getattr(args, "exit_duration_in_mins", None)
    if not duration and exit_signal is None:
        return None
    from .initialize import collective_device

    flags = torch.tensor([int(bool(duration) and (time.time() - start_time) / 60.0 > duration),
                          int(exit_signal is not None and exit_signal.received)], dtype=torch.int32,
                         device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1].item():
        return "--exit-signal-handler: SIGTERM received"
    if flags[0].item():
        return f"--exit-duration-in-mins {duration}"
    return None


def open_tensorboard(args: argparse.Namespace) -> TensorBoard:
    """The run's TensorBoard writer, on the last rank (which logs), with ``--tensorboard-dir``."""
    tb = TensorBoard(args.tensorboard_dir if dist.get_rank() == dist.get_world_size() - 1 else None)
    if tb.reason:
        print_rank_last(f"WARNING: {tb.reason}")
    return tb


def train(args: argparse.Namespace, model: Sequence, optimizer, scheduler, train_iter, valid_iter, *,
          start_iteration: int, consumed_train_samples: int, consumed_valid_samples: int,
          save_fn: Optional[Callable[[int, int, int], None]] = None, start_time: float,
          exit_signal: Optional[ExitSignal] = None, tb: TensorBoard) -> Dict[str, Any]:
    """Run iterations ``start_iteration+1 .. --train-iters``; returns the loss history and data position, and
    ``exited`` (True when --exit-interval, --exit-duration-in-mins or --exit-signal-handler stopped it early, after
    saving with ``save_fn``, as Megatron-LM does)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.optimizer.megatron_config import attach_to_schedules

    attach_to_schedules(model, optimizer)
    fb = get_forward_backward_func()
    ramp = rampup_calculator(args)   # None: every iteration takes --global-batch-size samples

    history: Dict[int, float] = {}
    evals: Dict[int, float] = {}
    logged: Dict[int, Dict[str, Any]] = {}  # each log line's values by iteration (lm loss on the last stage only)
    stats = IntervalStats()
    for chunk in model:
        chunk.ledger.reset()
    iteration = start_iteration
    total_skipped = 0
    memory: Optional[Dict[str, int]] = None   # the first logged iteration's model-state bytes (report_memory)
    exited = False
    for chunk in model:
        chunk.train()
    spec = getattr(model[0], "speculation", None)   # --odo-speculative-step (one chunk): rounds per log interval
    spec_seen = (spec.committed, spec.rolled_back) if spec is not None else None
    batch = global_batch_size_at(ramp, args, consumed_train_samples)
    saved_at = None   # the iteration last saved, so that a ramp step and --save-interval do not save it twice
    while iteration < args.train_iters:
        previous, batch = batch, global_batch_size_at(ramp, args, consumed_train_samples)
        if batch != previous:
            # As Megatron-LM: a checkpoint before each ramp step (with --save), and a line saying so
            print_rank_0(f"ramping up batch size from {previous} to {batch}")
            if save_fn is not None and saved_at != iteration:
                with ledger_paused(model):
                    save_fn(iteration, consumed_train_samples, consumed_valid_samples)
                saved_at = iteration
                stats.t0 = time.perf_counter()
        loss, ok, grad_norm, num_zeros = train_step(args, fb, model, optimizer, scheduler, train_iter, batch)
        iteration += 1
        consumed_train_samples += batch
        stats.add(loss, ok, grad_norm, samples=batch)
        total_skipped += 0 if ok else 1
        if loss is not None and math.isfinite(loss):
            history[iteration] = loss

        if iteration % args.log_interval == 0:
            elapsed = (time.perf_counter() - stats.t0) / stats.iters
            intra, inter = mean_bytes_per_rank([chunk.ledger for chunk in model], stats.iters)
            lr = logged_lr(optimizer.param_groups)
            lm = stats.lm_loss
            scale = float(optimizer.get_loss_scale())
            # Megatron-LM's optional fields: the last iteration's zeros, the weights' norm now (a collective)
            params_norm = optimizer.get_params_norm() if args.log_params_norm else None
            rounds = None
            if spec is not None:
                rounds = (spec.committed - spec_seen[0], spec.rolled_back - spec_seen[1])
                spec_seen = (spec.committed, spec.rolled_back)
            print_rank_last(format_train_line(
                iteration=iteration, train_iters=args.train_iters, consumed_samples=consumed_train_samples,
                elapsed_ms=elapsed * 1000,
                tflops_per_rank=num_floating_point_operations(args, stats.samples / stats.iters) / (
                    elapsed * args.world_size * 1e12),
                tokens_per_sec_per_rank=stats.samples / stats.iters * args.seq_length / (elapsed * args.world_size),
                lr=lr, global_batch_size=batch, lm_loss=lm, loss_scale=scale, grad_norm=stats.grad_norm,
                skipped=stats.skipped, nan_iters=stats.nan, intra_bytes=intra, inter_bytes=inter,
                plan=model[0].plan.short(), speculative=rounds, num_zeros=num_zeros, params_norm=params_norm))
            tb.scalars(iteration, {"lm loss": lm, "learning-rate": lr, "grad-norm": stats.grad_norm,
                                   "loss-scale": scale, "iteration-time": elapsed, "batch-size": batch,
                                   "num-zeros": num_zeros,
                                   "params-norm": params_norm,
                                   "bytes-per-step/intra-node": intra, "bytes-per-step/inter-node": inter})
            logged[iteration] = {"lr": lr, "lm_loss": lm, "skipped": stats.skipped, "global_batch_size": batch,
                                 "intra_bytes": intra,
                                 "inter_bytes": inter, "num_zeros": num_zeros, "params_norm": params_norm}
            if memory is None and iteration - start_iteration > total_skipped:
                # once, as Megatron-LM's report_memory (DP rank 0 of each TP/PP position), after an applied update
                # (the optimizer's states exist from then on: fp16's first steps are skipped while the scale falls)
                memory = report_memory(model, iteration)
            for chunk in model:
                chunk.ledger.reset()
            stats.reset()

        if args.eval_iters > 0 and iteration % args.eval_interval == 0 and valid_iter is not None:
            val = evaluate_and_print(args, fb, model, optimizer, valid_iter, iteration, f"iteration {iteration}", tb,
                                     "lm loss validation")
            consumed_valid_samples += args.eval_iters * args.global_batch_size
            if val is not None:
                evals[iteration] = val
            stats.t0 = time.perf_counter()  # keep eval time out of the next line's ms/iteration

        reason = None
        if args.exit_interval and iteration % args.exit_interval == 0:
            reason = f"--exit-interval {args.exit_interval}"
        elif iteration < args.train_iters:
            reason = exit_requested(args, start_time, exit_signal)
        if save_fn is not None and (reason or (args.save_interval and iteration % args.save_interval == 0)):
            with ledger_paused(model):
                save_fn(iteration, consumed_train_samples, consumed_valid_samples)
            saved_at = iteration
            stats.t0 = time.perf_counter()
        if reason:
            print_rank_0(f"exiting at iteration {iteration} ({reason})")
            exited = True
            break
    return {"iteration": iteration, "losses": history, "eval": evals, "skipped": total_skipped, "log": logged,
            "consumed_train_samples": consumed_train_samples, "consumed_valid_samples": consumed_valid_samples,
            "exited": exited, "memory": memory}


def mean_bytes_per_rank(ledgers: Sequence, iters: int) -> Tuple[float, float]:
    """Bytes sent per step inside the node and across nodes, averaged over every rank: one small all-reduce per log
    line, since some backends load their ranks unevenly (ring, ByteGrad's leader hops), so no single rank's count
    stands for the run. Counted as the collectives' protocol sends them (the ledger's closed forms)."""
    from .initialize import collective_device

    totals = [ledger.summary().get("total", {}) for ledger in ledgers]   # one ledger per model chunk
    traffic = torch.tensor([float(sum(t.get(side, 0) for t in totals)) for side in ("intra", "inter")],
                           dtype=torch.float64, device=collective_device())
    dist.all_reduce(traffic)
    intra, inter = (traffic / (iters * dist.get_world_size())).tolist()
    return intra, inter


def report_memory(model: Sequence, iteration: int) -> Dict[str, int]:
    """This rank's model-state bytes, all chunks together (printed by DP rank 0 of each model-parallel position)."""
    from megatron.core import parallel_state as ps

    report: Dict[str, int] = {}
    for chunk in model:
        for key, value in chunk.memory_report().items():
            report[key] = report.get(key, 0) + value
    if ps.get_data_parallel_rank() == 0:
        device = None
        if torch.cuda.is_available():
            device = {"allocated": torch.cuda.memory_allocated(), "max allocated": torch.cuda.max_memory_allocated(),
                      "reserved": torch.cuda.memory_reserved()}
        print(format_memory_line(dist.get_rank(), iteration, report, device), flush=True)
    return report
