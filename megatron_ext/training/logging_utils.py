"""Megatron-style training log lines, the FLOP count behind TFLOP/s, and optional TensorBoard.

The line layout follows Megatron-LM's ``training_log`` (``iteration N/ M | consumed samples: ... | ...``) so
existing log parsers keep working; this project adds tokens/s per rank and the bytes sent per step inside a node
and across nodes (the mean over the ranks), from the ODO's communication ledger.
"""
from __future__ import annotations

import argparse
import datetime
import math
from typing import Dict, Optional, Tuple


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Model FLOPs of one training iteration on ``batch_size`` sequences (Megatron-LM's dense-GPT count).

    Every GEMM runs three times (forward, input-gradient and weight-gradient backward) and an m x n by n x k GEMM
    costs 2mnk, hence the factor 6 on every term. Per token and layer: the Q/K/V projections (K and V with
    ``num_query_groups`` heads under GQA) and the output projection; QK^T and attention x V, each over half the
    sequence because of the causal mask; and the MLP's two GEMMs (three with SwiGLU). Plus the logit layer once.
    """
    h, L, s = args.hidden_size, args.num_layers, args.seq_length
    heads = args.num_attention_heads
    kv_channels = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    q_size, kv_size = kv_channels * heads, kv_channels * groups
    ffn_gemms = 3 if args.swiglu else 2
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size or 0
    attention = h * (q_size + 2 * kv_size) + q_size * s + q_size * h   # qkv proj, causal QK^T + AV, out proj
    mlp = h * args.ffn_hidden_size * ffn_gemms
    per_token = 6 * (L * (attention + mlp) + h * vocab)
    return float(batch_size * s * per_token)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_significant(x: float) -> str:
    """Megatron's one decimal for GPU-sized values; 3 significant digits below 10 so that CPU runs (a few
    GFLOP/s, i.e. 0.00x TFLOP/s) do not print 0.000."""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:#.3g}"


def format_train_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                      tflops_per_rank: float, tokens_per_sec_per_rank: float, lr: float, global_batch_size: int,
                      lm_loss: Optional[float], loss_scale: float, grad_norm: Optional[float], skipped: int,
                      nan_iters: int, intra_bytes: float, inter_bytes: float, plan: Optional[str] = None,
                      speculative: Optional[Tuple[int, int]] = None, num_zeros: Optional[int] = None,
                      params_norm: Optional[float] = None) -> str:
    """One Megatron-LM-style log line (values averaged over the log interval); ``speculative``: the interval's
    speculative rounds (committed, rolled back) under --odo-speculative-step; ``num_zeros`` / ``params_norm``
    under --log-num-zeros-in-grad / --log-params-norm, where Megatron-LM prints them."""
    ts = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{ts}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {fmt_significant(tflops_per_rank)}",
        f"tokens per second per GPU: {tokens_per_sec_per_rank:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    if lm_loss is not None:
        parts.append(f"lm loss: {lm_loss:.6E}")
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {float(num_zeros):.1f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nan_iters:3d}"]
    if plan is not None:
        parts.append(f"sharding: {plan}")
    if speculative is not None:
        parts.append(f"speculative steps committed: {speculative[0]}/{sum(speculative)}")
    parts += [f"bytes sent per step and rank (mean) intra-node: {_fmt_bytes(intra_bytes)}",
              f"inter-node: {_fmt_bytes(inter_bytes)}"]
    return " | ".join(parts) + " |"


def format_memory_line(rank: int, iteration: int, report: Dict[str, int],
                       device: Optional[Dict[str, float]] = None) -> str:
    """Megatron-LM's ``report_memory`` line, once after the first logged iteration: the model-state bytes this rank
    holds, measured from its tensors (``OverlappedDDP.memory_report()``: what a sharding plan saves), in MB, then
    the CUDA allocator's figures where there is one. Components this plan does not have (zero) are left out."""
    mb = 1024 * 1024
    parts = [f"[Rank {rank}] (after {iteration} iterations) model-state memory (MB)"]
    parts += [f"{k.replace('_', ' ')}: {v / mb:.1f}" for k, v in report.items() if v]
    parts.append(f"total: {sum(report.values()) / mb:.1f}")
    parts += [f"{k}: {v / mb:.1f}" for k, v in (device or {}).items()]
    return " | ".join(parts)


def format_eval_line(prefix: str, losses: Dict[str, float]) -> str:
    parts = [f" validation loss at {prefix}"]
    for k, v in losses.items():
        parts.append(f"{k} value: {v:.6E}")
        parts.append(f"{k} PPL: {math.exp(min(20.0, v)):.6E}")
    line = " | ".join(parts) + " |"
    bar = "-" * len(line)
    return f"{bar}\n{line}\n{bar}"


class TensorBoard:
    """SummaryWriter when ``--tensorboard-dir`` is given and tensorboard is importable; a no-op otherwise."""

    def __init__(self, log_dir: Optional[str]) -> None:
        self.writer = None
        self.reason = None
        if not log_dir:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # tensorboard is optional
            self.reason = f"--tensorboard-dir given but tensorboard is not importable ({e}); not writing events"
            return
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, step: int, values: Dict[str, Optional[float]]) -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if v is not None and math.isfinite(v):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
