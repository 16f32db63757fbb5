#!/usr/bin/env python
"""Step time and peak memory per rank of the OverlappedDistributedOptimizer against its peers, on a gloo world
(``--device cpu``, the default) or on GPUs with NCCL (``--device cuda``, one rank per GPU).

One run, one model (a residual stack of LayerNorm -> Linear -> GELU -> Linear blocks, ``--params`` elements, fp32 or
bf16), the same data and the same number of micro-batches for every configuration:

  * ``odo``       -- ``mx.OverlappedDDP`` + ``mx.OverlappedDistributedOptimizer`` for every accumulation policy
                     (``shard``, ``local``, ``auto``) with overlap on (grad reduce-scatter during backward, param
                     all-gather during the next forward) and off;
  * ``ddp+zero``  -- torch DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (``overlap_with_ddp=False``:
                     gloo refuses ``True``), accumulation under ``no_sync()``; the ratio column is relative to it;
  * ``fsdp2``     -- ``torch.distributed.fsdp.fully_shard`` per block and at the root on a 1-D device mesh
                     with ``reshard_after_forward=False`` (ZeRO-2-like: one all-gather and one reduce-scatter per
                     step, like the ODO), accumulation with ``set_requires_gradient_sync(False)``;
  * ``deepspeed`` -- DeepSpeed ZeRO-2 (gloo or NCCL, as the run) with the same torch AdamW as client optimizer,
                     when ``deepspeed`` imports (skipped with the reason otherwise);
  * ``mcore``     -- (``--device cuda`` only: it needs CUDA) megatron-core's own ``DistributedDataParallel`` +
                     ``DistributedOptimizer`` with overlapped grad reduce and param gather, the baseline a Megatron
                     user compares with; the ratio column is relative to it on GPUs;
  * ``no-comm``   -- the same model and torch AdamW on every rank with no collective at all: the step time with
                     zero communication, the floor that overlap can at best reach (it runs the *unsharded* Adam).

Every configuration uses AdamW (lr 1e-4, weight decay 0.01 except biases and 1-D params, as megatron-core groups
them), gradient clipping at ``--clip-grad`` by the global norm, loss averaged over micro-batches, and the same
bucket size (``--bucket-size`` elements; DDP ``bucket_cap_mb`` and DeepSpeed ``reduce_bucket_size`` set to match;
FSDP2 communicates per block).

What is measured
  * ms/step: every rank stamps the end of each step in one back-to-back loop (no barrier between steps, so an
    overlapped all-gather still in flight at the end of a step is paid by the next one); step time = the slowest
    rank's interval, median over ``--steps`` steps after ``--warmup`` warm-up steps. On a few oversubscribed
    cores the spread is large (+-50% between runs): compare ratios within one run, not across runs.
  * peak memory delta, CPU: peak RSS delta. Each configuration runs in freshly forked processes. After the imports
    and the process group, a rank first runs the same configuration for two steps on a tiny model (so that paging in
    library code -- kernels, gloo, DeepSpeed's engine -- is not charged to the configuration; ``--no-prewarm`` turns
    this off), then resets the kernel's resident-set high-water mark (``/proc/self/clear_refs`` = 5), records its
    current RSS, builds model and optimizer and trains; the delta is ``VmHWM - RSS before the model``: every byte
    the configuration made resident (weights, gradients, buckets, optimizer state, communication buffers,
    activations, allocator slack). Reported as the max over ranks. If the high-water mark cannot be reset, the
    process-lifetime ``ru_maxrss`` is used and the JSON says so (``hwm_reset: false``). On GPUs: the peak of
    ``torch.cuda.max_memory_allocated`` over the run minus what was allocated before the model was built.
  * opt-state MB: bytes held by the inner torch optimizer on one rank (its state plus any parameter copies it
    owns that are not the model's weights, e.g. fp32 master shards); counted from the tensors, max over ranks.
  * sent MB/step: bytes one rank sends per step (mean over ranks), from the ODO's communication ledger
    (pairwise-exchange model, see ``megatron_ext/comm/ledger.py``); peers have no ledger.
  * final loss: mean over ranks of the last step's loss, a cross-check that all configurations train alike.

    python tools/bench_optimizer.py                      # 4 ranks, ~4M params, 1 and 4 micro-batches
    python tools/bench_optimizer.py --skip-peers --micro-batches 8 --out odo_only.json
    python tools/bench_optimizer.py --device cuda --world-size 1 --params 1e8 --width 1024   # one GPU
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR = 1e-4
WEIGHT_DECAY = 0.01
HPZ = 2   # hpZ secondary group (ranks) for the --zero3 rows
MB = 1024 * 1024


# ------------------------------------------------------------------------------------------------------------------
# model and data
# ------------------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residual MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """A stack of :class:`Block` followed by a final LayerNorm and a linear head."""

    def __init__(self, width: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def block_params(width: int, hidden: int) -> int:
    return 2 * width + width * hidden + hidden + hidden * width + width


def depth_for(params: float, width: int, hidden: int) -> int:
    """Number of blocks so that the model has about ``params`` elements."""
    rest = 2 * width + width * width + width
    return max(1, round((params - rest) / block_params(width, hidden)))


def build_model(args: dict) -> Net:
    torch.manual_seed(args["seed"])  # identical initial weights on every rank and in every configuration
    return Net(args["width"], args["hidden"], args["depth"]).to(args["device"], DTYPES[args["dtype"]])


def make_batches(args: dict, rank: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches (the same ones every step and in every configuration)."""
    out = []
    for i in range(args["micro_batches"]):
        g = torch.Generator().manual_seed(args["seed"] * 1_000_003 + rank * 1009 + i)
        x = torch.randn(args["batch"], args["width"], generator=g)
        y = torch.randn(args["batch"], args["width"], generator=g)
        out.append((x.to(args["device"], DTYPES[args["dtype"]]), y.to(args["device"], DTYPES[args["dtype"]])))
    return out


def param_groups(module: nn.Module) -> List[dict]:
    """megatron-core's grouping, as the ODO does it: no weight decay for biases and 1-D parameters."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def accumulate(model: nn.Module, batches, backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> float:
    """Forward and backward every micro-batch under ``model.no_sync()`` except the last; returns the mean loss."""
    n, total = len(batches), 0.0
    for i, (x, y) in enumerate(batches):
        with (model.no_sync() if i < n - 1 else contextlib.nullcontext()):
            loss = loss_fn(model(x), y) / n
            backward(loss)
        total += loss.item()
    return total


# ------------------------------------------------------------------------------------------------------------------
# memory probes
# ------------------------------------------------------------------------------------------------------------------
def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def current_rss() -> int:
    """Resident set size of this process, bytes."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmHWM") is not None
    except OSError:
        return False


def peak_rss(hwm_reset: bool) -> int:
    """Peak RSS since :func:`reset_peak_rss` (or since process start when it could not reset), bytes."""
    kb = _status_kb("VmHWM") if hwm_reset else None
    if kb is not None:
        return kb * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_bytes(opt: torch.optim.Optimizer, model: nn.Module) -> int:
    """Bytes of the tensors a torch optimizer holds that are not the model's own weights (state, master copies)."""
    model_storages = {_local(p.detach()).untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not torch.is_tensor(t):
            return
        t = _local(t.detach())
        if t.numel() == 0:
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or key in model_storages:
            return
        seen.add(key)
        total += st.nbytes()

    for g in opt.param_groups:
        for p in g["params"]:
            add(p)
    for s in opt.state.values():
        for v in s.values():
            add(v)
    return total


# ------------------------------------------------------------------------------------------------------------------
# configurations: each returns (step function, optimizer-bytes function, extra-report function)
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    kind: str                      # odo | ddp+zero | fsdp2 | deepspeed | mcore | no-comm
    micro_batches: int
    accumulate: str = ""           # odo only
    overlap: bool = True           # odo only
    variant: str = ""              # "zero3" / "zero3-hpz": parameter sharding (odo, fsdp2, deepspeed)

    @property
    def label(self) -> str:
        v = {"": "", "zero3": " ZeRO-3", "zero3-hpz": " ZeRO-3 + hpZ"}[self.variant]
        if self.kind == "odo":
            return f"ODO{v} {self.accumulate} overlap={'on' if self.overlap else 'off'}"
        if self.variant:
            return {"fsdp2": {"zero3": "FSDP2 reshard_after_forward=True",
                              "zero3-hpz": "FSDP2 reshard_after_forward=2 (hpZ-like)"},
                    "deepspeed": {"zero3": "DeepSpeed ZeRO-3", "zero3-hpz": "DeepSpeed ZeRO-3 + hpZ 2"}}[
                        self.kind][self.variant]
        return {"ddp+zero": "DDP + ZeroRedundancyOptimizer", "fsdp2": "FSDP2 fully_shard",
                "deepspeed": "DeepSpeed ZeRO-2", "mcore": "megatron-core DDP + DistributedOptimizer",
                "no-comm": "no-comm (local AdamW)"}[self.kind]


StepFn = Callable[[], float]
Setup = Tuple[StepFn, Callable[[], int], Callable[[], dict]]


def _setup_odo(cfg: Config, args: dict, batches) -> Setup:
    import megatron_ext as mx
    from megatron.core.optimizer import OptimizerConfig

    plan = {"": mx.ShardingPlan(), "zero3": mx.ShardingPlan.zero3(),
            "zero3-hpz": mx.ShardingPlan.zero3(hpz=HPZ)}[cfg.variant]
    model = mx.OverlappedDDP(build_model(args), mx.OverlapConfig(
        bucket_size=args["bucket_size"], accumulate=cfg.accumulate, overlap_grad_reduce=cfg.overlap,
        overlap_param_gather=cfg.overlap, grad_reduce="plain", param_gather="plain", sharding=plan))
    opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=args["clip_grad"],
        bf16=args["dtype"] == "bf16", fp16=False), model)

    def step() -> float:
        total = accumulate(model, batches, lambda loss: opt.scale_loss(loss).backward())
        model.finish_grad_sync()
        ok, _, _ = opt.step()
        if not ok:
            raise RuntimeError("ODO skipped a step (no loss scaling here)")
        opt.zero_grad()
        return total

    def extra() -> dict:
        opt.force_param_sync()
        return {"buffer_stats": model.buffer_stats(), "num_buckets": len(model.buckets)}

    step.ledger = model.ledger  # type: ignore[attr-defined]
    return step, lambda: optimizer_bytes(opt.inner, model), extra


def _setup_ddp_zero(cfg: Config, args: dict, batches) -> Setup:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = build_model(args)
    model = DDP(module, bucket_cap_mb=args["bucket_size"] * 4 / MB)
    opt = ZeroRedundancyOptimizer(param_groups(module), optimizer_class=torch.optim.AdamW, lr=LR,
                                  overlap_with_ddp=False, foreach=True)

    def step() -> float:
        total = accumulate(model, batches)
        if args["clip_grad"] > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), args["clip_grad"])  # grads are replicated
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, lambda: optimizer_bytes(opt.optim, module), dict


def _setup_fsdp2(cfg: Config, args: dict, batches) -> Setup:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(args["device"], (dist.get_world_size(),))
    model = build_model(args)
    reshard = {"": False, "zero3": True, "zero3-hpz": HPZ}[cfg.variant]
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, foreach=True)
    n = len(batches)

    def step() -> float:
        total = 0.0
        for i, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(i == n - 1)
            loss = loss_fn(model(x), y) / n
            loss.backward()
            total += loss.item()
        if args["clip_grad"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args["clip_grad"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, lambda: optimizer_bytes(opt, model), dict


def _setup_deepspeed(cfg: Config, args: dict, batches) -> Setup:
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    module = build_model(args)
    client_opt = torch.optim.AdamW(param_groups(module), lr=LR, foreach=True)
    ds_config = {
        "train_micro_batch_size_per_gpu": args["batch"],
        "gradient_accumulation_steps": len(batches),
        "gradient_clipping": args["clip_grad"],
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": args["bucket_size"],
                              "allgather_bucket_size": args["bucket_size"], "overlap_comm": False,
                              "contiguous_gradients": True},
        "bf16": {"enabled": args["dtype"] == "bf16"},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if cfg.variant:
        ds_config["zero_optimization"] = {"stage": 3, "reduce_bucket_size": args["bucket_size"],
                                          "stage3_prefetch_bucket_size": args["bucket_size"], "overlap_comm": False,
                                          "contiguous_gradients": True}
        if cfg.variant == "zero3-hpz":
            ds_config["zero_optimization"]["zero_hpz_partition_size"] = HPZ
    engine, opt, _, _ = deepspeed.initialize(model=module, optimizer=client_opt, config=ds_config)

    def step() -> float:
        total = 0.0
        for x, y in batches:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            engine.step()          # the optimizer steps at the accumulation boundary only
            total += loss.item() / len(batches)
        return total

    inner = getattr(opt, "optimizer", opt)
    return step, lambda: optimizer_bytes(inner, engine.module), dict


def _setup_mcore(cfg: Config, args: dict, batches) -> Setup:
    """megatron-core's DDP + DistributedOptimizer, configured as Megatron-LM runs them with
    ``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` (and ``--bf16`` with bf16)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    bf16 = args["dtype"] == "bf16"
    tcfg = TransformerConfig(num_layers=1, hidden_size=args["width"], num_attention_heads=1, bf16=bf16,
                             params_dtype=DTYPES[args["dtype"]])
    # Megatron-LM forces --accumulate-allreduce-grads-in-fp32 with --bf16
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                            overlap_param_gather=True, bucket_size=args["bucket_size"],
                                            grad_reduce_in_fp32=bf16)
    model = DistributedDataParallel(tcfg, ddp_cfg, build_model(args))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY,
                                                 clip_grad=args["clip_grad"], bf16=bf16, fp16=False,
                                                 use_distributed_optimizer=True), [model])

    def step() -> float:
        model.zero_grad_buffer()
        opt.zero_grad()
        total = accumulate(model, batches)
        model.finish_grad_sync()
        ok, _, _ = opt.step()
        if not ok:
            raise RuntimeError("megatron-core skipped a step (no loss scaling here)")
        return total

    def opt_bytes() -> int:
        return sum(optimizer_bytes(o, model) for o in getattr(opt, "chained_optimizers", [opt])
                   for o in [o.optimizer])

    return step, opt_bytes, dict


def _setup_no_comm(cfg: Config, args: dict, batches) -> Setup:
    model = build_model(args)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, foreach=True)
    n = len(batches)

    def step() -> float:
        total = 0.0
        for x, y in batches:
            loss = loss_fn(model(x), y) / n
            loss.backward()
            total += loss.item()
        if args["clip_grad"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args["clip_grad"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, lambda: optimizer_bytes(opt, model), dict


SETUPS: Dict[str, Callable[[Config, dict, Any], Setup]] = {
    "odo": _setup_odo, "ddp+zero": _setup_ddp_zero, "fsdp2": _setup_fsdp2, "deepspeed": _setup_deepspeed,
    "mcore": _setup_mcore, "no-comm": _setup_no_comm,
}


# ------------------------------------------------------------------------------------------------------------------
# one configuration on one rank
# ------------------------------------------------------------------------------------------------------------------
def _prewarm(cfg: Config, args: dict, rank: int) -> None:
    """Run the configuration once on a tiny model, so that what the baseline RSS excludes is the one-off cost of
    paging in library code (kernels, gloo, DeepSpeed's engine) rather than anything that scales with the model."""
    tiny = dict(args, width=16, hidden=64, depth=1, batch=2, bucket_size=512)
    step, opt_bytes, extra = SETUPS[cfg.kind](cfg, tiny, make_batches(tiny, rank))
    for _ in range(2):
        step()
    extra()
    opt_bytes()
    del step, opt_bytes, extra
    gc.collect()


def _rank_main(rank: int, world: int, port: int, cfg: Config, args: dict, outdir: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(args["threads"])
    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args["timeout"]))
    try:
        batches = make_batches(args, rank)
        if args["prewarm"]:
            _prewarm(cfg, args, rank)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            hwm_reset, rss0 = True, torch.cuda.memory_allocated()
        else:
            hwm_reset = reset_peak_rss()
            rss0 = current_rss()
        step, opt_bytes, extra = SETUPS[cfg.kind](cfg, args, batches)
        ledger = getattr(step, "ledger", None)
        dist.barrier()
        stamps = [time.perf_counter()]
        losses = []
        for s in range(args["warmup"] + args["steps"]):
            if ledger is not None and s == args["warmup"]:
                ledger.reset()  # drop the initial broadcast and the warm-up steps
            losses.append(step())
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
        sent = ledger.summary() if ledger is not None else None
        info = extra()
        peak = torch.cuda.max_memory_allocated() if cuda else peak_rss(hwm_reset)
        result = {
            "rank": rank,
            "step_s": [b - a for a, b in zip(stamps, stamps[1:])][args["warmup"]:],
            "losses": losses,
            "rss_before_model": rss0,
            "peak_rss_delta": peak - rss0,
            "hwm_reset": hwm_reset,
            "optimizer_bytes": opt_bytes(),
            "ledger": sent,
            **info,
        }
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(cfg: Config, args: dict, world: int) -> dict:
    """Run one configuration in ``world`` freshly forked processes and aggregate the ranks' results."""
    with tempfile.TemporaryDirectory(prefix="mx_bench_opt_") as d:
        t0 = time.time()
        mp.start_processes(_rank_main, args=(world, _free_port(), cfg, args, d), nprocs=world,
                           start_method=args["start_method"], join=True)
        wall = time.time() - t0
        ranks = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(args["steps"])]
    out = {
        "label": cfg.label, **dataclasses.asdict(cfg),
        "ms_per_step": 1e3 * statistics.median(per_step),
        "ms_per_step_min": 1e3 * min(per_step),
        "ms_per_step_all": [1e3 * t for t in per_step],
        "peak_rss_delta_mb": max(r["peak_rss_delta"] for r in ranks) / MB,
        "peak_rss_delta_mb_per_rank": [r["peak_rss_delta"] / MB for r in ranks],
        "rss_before_model_mb": [r["rss_before_model"] / MB for r in ranks],
        "hwm_reset": all(r["hwm_reset"] for r in ranks),
        "optimizer_mb": max(r["optimizer_bytes"] for r in ranks) / MB,
        "final_loss": statistics.mean(r["losses"][-1] for r in ranks),
        "first_loss": statistics.mean(r["losses"][0] for r in ranks),
        "wall_s": wall,
    }
    if ranks[0].get("ledger") is not None:
        out["sent_mb_per_step"] = statistics.mean(r["ledger"]["total"]["total"] for r in ranks) / MB / args["steps"]
        out["ledger_rank0"] = ranks[0]["ledger"]
    for k in ("buffer_stats", "num_buckets"):
        if k in ranks[0]:
            out[k] = [r[k] for r in ranks]
    return out


# ------------------------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------------------------
def deepspeed_status() -> Optional[str]:
    """None when DeepSpeed can be used, else the reason it is skipped."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure means: skip it)
        return f"deepspeed does not import ({type(e).__name__}: {e})"
    return None


def configs(micro_batches: List[int], skip_peers: bool, ds_ok: bool, device: str = "cpu",
            accumulate: Tuple[str, ...] = ("shard", "local", "auto"), zero3: bool = False) -> List[Config]:
    out: List[Config] = []
    for m in micro_batches:
        if zero3:   # parameter sharding, against FSDP2's reshard_after_forward and DeepSpeed ZeRO-3 (+ hpZ)
            for v in ("zero3", "zero3-hpz"):
                out.append(Config("odo", m, "auto", True, v))
                if not skip_peers:
                    out.append(Config("fsdp2", m, variant=v))
                    if ds_ok:
                        out.append(Config("deepspeed", m, variant=v))
        out.append(Config("no-comm", m))
        if not skip_peers:
            if device == "cuda":
                out.append(Config("mcore", m))
            out.append(Config("ddp+zero", m))
            out.append(Config("fsdp2", m))
            if ds_ok:
                out.append(Config("deepspeed", m))
        for acc in accumulate:
            for ov in (True, False):
                out.append(Config("odo", m, acc, ov))
    return out


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: List[dict], ref_kind: str = "ddp+zero", memory: str = "peak RSS d MB") -> str:
    head = ["configuration", "mb", "ms/step", "x ref", memory, "opt-state MB", "sent MB/step",
            "final loss"]
    lines = []
    for m in sorted({r["micro_batches"] for r in rows}):
        group = [r for r in rows if r["micro_batches"] == m]
        ok = [r for r in group if "error" not in r]
        ref = next((r for r in ok if r["kind"] == ref_kind), None)
        if ref is None and ok:
            ref = min((r for r in ok if r["kind"] != "no-comm"), key=lambda r: r["ms_per_step"], default=None)
        for r in group:
            if "error" in r:
                lines.append([r["label"], str(m), "failed: " + r["error"].splitlines()[-1][:60], "", "", "", "", ""])
                continue
            r["ratio_to_ref"] = r["ms_per_step"] / ref["ms_per_step"] if ref else None
            r["ref"] = ref["label"] if ref else None
            lines.append([r["label"], str(m), _fmt(r["ms_per_step"], ".0f"), _fmt(r["ratio_to_ref"], ".2f"),
                          _fmt(r["peak_rss_delta_mb"], ".1f"), _fmt(r["optimizer_mb"], ".1f"),
                          _fmt(r.get("sent_mb_per_step"), ".1f"), _fmt(r["final_loss"], ".5f")])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    sep = "-+-".join("-" * w for w in widths)
    fmt_row = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt_row(head), sep]
    prev = None
    for l in lines:
        if prev is not None and l[1] != prev:
            out.append(sep)
        out.append(fmt_row(l))
        prev = l[1]
    return "\n".join(out)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo ranks on CPU cores; cuda: NCCL, one rank per GPU (default cpu)")
    p.add_argument("--world-size", type=int, default=4, help="ranks (default 4; at most the GPU count on cuda)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="parameter dtype (default fp32). bf16: the ODO and megatron-core keep fp32 master shards "
                        "and reduce gradients in fp32; the torch peers run pure bf16 AdamW, so compare the ODO "
                        "with mcore there")
    p.add_argument("--odo-accumulate", default="shard,local,auto",
                   help="comma-separated ODO accumulation policies to run (default: shard,local,auto)")
    p.add_argument("--params", type=float, default=4e6, help="approximate model size in elements (default 4e6)")
    p.add_argument("--width", type=int, default=256, help="model width (default 256; hidden = 4 x width)")
    p.add_argument("--batch", type=int, default=16, help="rows per micro-batch per rank (default 16)")
    p.add_argument("--micro-batches", type=str, default="1,4",
                   help="comma-separated micro-batch counts, each run for every configuration (default 1,4)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    p.add_argument("--bucket-size", type=int, default=1_000_000,
                   help="bucket size in elements for the ODO, DDP and DeepSpeed (default 1e6)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="global-norm clipping for all (default 1.0)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--zero3", action="store_true",
                   help="add parameter-sharding rows: ODO ZeRO-3 and ZeRO-3 + hpZ (2), FSDP2 with "
                   "reshard_after_forward=True and =2, DeepSpeed ZeRO-3 with and without zero_hpz_partition_size 2")
    p.add_argument("--skip-peers", action="store_true",
                   help="only the ODO configurations and the no-comm floor (no DDP+ZeRO, FSDP2, DeepSpeed)")
    p.add_argument("--only", type=str, default="",
                   help="comma-separated kinds to run (odo, ddp+zero, fsdp2, deepspeed, mcore, no-comm); default all")
    p.add_argument("--start-method", choices=("fork", "spawn"), default=None,
                   help="how rank processes start; default fork on CPU (reuses this process's imports), spawn on "
                        "cuda (a forked child cannot initialise CUDA)")
    p.add_argument("--no-prewarm", action="store_true",
                   help="do not run each configuration on a tiny model before the RSS baseline (see above)")
    p.add_argument("--timeout", type=int, default=300, help="collective timeout in seconds (default 300)")
    p.add_argument("--out", type=str, default="bench_optimizer.json", help="JSON output path")
    args = p.parse_args(argv)
    if args.device == "cpu" and args.world_size < 2:
        p.error("--world-size must be >= 2 on cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available")
        if not 1 <= args.world_size <= torch.cuda.device_count():
            p.error(f"--world-size must be 1..{torch.cuda.device_count()} on cuda (one rank per GPU)")
    args.odo_accumulate = tuple(x.strip() for x in args.odo_accumulate.split(",") if x.strip())
    if not args.odo_accumulate or not set(args.odo_accumulate) <= {"shard", "local", "auto"}:
        p.error(f"--odo-accumulate takes shard, local and/or auto, got {args.odo_accumulate!r}")
    if args.start_method is None:
        args.start_method = "spawn" if args.device == "cuda" else "fork"
    if args.device == "cuda" and args.start_method == "fork":
        p.error("--start-method fork cannot be used with --device cuda: the parent has initialised CUDA")
    try:
        args.micro_batch_list = sorted({int(x) for x in args.micro_batches.split(",") if x.strip()})
    except ValueError:
        p.error(f"--micro-batches must be comma-separated integers, got {args.micro_batches!r}")
    if not args.micro_batch_list or min(args.micro_batch_list) < 1:
        p.error("--micro-batches needs positive integers")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "mx_torch_extensions"))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import warnings
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch deprecations inside DeepSpeed
    # Imported once here so that forked ranks start with them loaded (and the imports are not measured).
    import megatron_ext  # noqa: F401
    from megatron.core.optimizer import OptimizerConfig  # noqa: F401
    from megatron_ext.optimizer import distributed_optimizer  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    hidden = 4 * a.width
    depth = depth_for(a.params, a.width, hidden)
    n_params = sum(p.numel() for p in Net(a.width, hidden, depth).parameters())
    args = dict(device=a.device, dtype=a.dtype, width=a.width, hidden=hidden, depth=depth, batch=a.batch,
                bucket_size=a.bucket_size, clip_grad=a.clip_grad, steps=a.steps, warmup=a.warmup, seed=a.seed,
                threads=a.threads, timeout=a.timeout, start_method=a.start_method, prewarm=not a.no_prewarm)
    skipped: Dict[str, str] = {}
    ds_reason = None if a.skip_peers else deepspeed_status()
    if a.skip_peers:
        skipped["peers"] = "--skip-peers"
    elif ds_reason:
        skipped["deepspeed"] = ds_reason
        print(f"DeepSpeed ZeRO-2 skipped: {ds_reason}", flush=True)
    cfgs = configs(a.micro_batch_list, a.skip_peers, ds_reason is None, a.device, a.odo_accumulate, a.zero3)
    if a.only:
        kinds = {k.strip() for k in a.only.split(",")}
        cfgs = [c for c in cfgs if c.kind in kinds]
    print(f"model: {depth} blocks, width {a.width}, hidden {hidden}, {n_params / 1e6:.2f}M {a.dtype} params "
          f"({n_params * DTYPES[a.dtype].itemsize / MB:.1f} MB); world {a.world_size} "
          f"{'NCCL ranks on ' + torch.cuda.get_device_name() if a.device == 'cuda' else 'gloo ranks on'} "
          f"{os.cpu_count()} cores, {a.threads} thread(s)/rank; batch {a.batch} rows/micro-batch/rank; "
          f"bucket {a.bucket_size} elements; "
          f"{a.warmup} warm-up + {a.steps} timed steps; {len(cfgs)} configurations", flush=True)
    rows: List[dict] = []
    t_start = time.time()
    for cfg in cfgs:
        run_args = dict(args, micro_batches=cfg.micro_batches)
        try:
            r = run_config(cfg, run_args, a.world_size)
            print(f"  {cfg.label:32s} mb={cfg.micro_batches}: {r['ms_per_step']:8.1f} ms/step, "
                  f"peak memory delta {r['peak_rss_delta_mb']:7.1f} MB, loss {r['final_loss']:.5f} "
                  f"({r['wall_s']:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001  (a failing peer must not stop the others)
            msg = f"{type(e).__name__}: {e}"
            print(f"  {cfg.label:32s} mb={cfg.micro_batches}: FAILED {msg.splitlines()[-1][:200]}", flush=True)
            r = {"label": cfg.label, **dataclasses.asdict(cfg), "error": msg + "\n" + traceback.format_exc()[-2000:]}
        rows.append(r)
    print()
    cuda = a.device == "cuda"
    txt = table(rows, "mcore" if cuda else "ddp+zero", "peak GPU mem d MB" if cuda else "peak RSS d MB")
    print(txt)
    print(f"\nms/step: median over steps of the slowest rank; 'x ref' = ratio to "
          f"{'megatron-core DDP + DistributedOptimizer' if cuda else 'DDP + ZeroRedundancyOptimizer'} at the "
          "same micro-batch count.\npeak memory d: max over ranks of the peak (VmHWM on CPU, max_memory_allocated "
          "on GPUs) minus what was resident before the model was built, fresh processes per configuration."
          "\nopt-state: bytes held by the inner torch optimizer per rank (state + master copies)."
          "\nsent: bytes one rank sends per step, from the ODO ledger. Timings on oversubscribed cores vary "
          "by +-50% between runs.")
    result = {
        "benchmark": "bench_optimizer",
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name() if cuda else None},
        "memory_probe": "cuda max_memory_allocated" if cuda else "VmHWM (RSS)",
        "model": {"blocks": depth, "width": a.width, "hidden": hidden, "params": n_params, "dtype": a.dtype},
        "settings": {k: v for k, v in args.items()} | {"world_size": a.world_size,
                                                      "micro_batches": a.micro_batch_list, "lr": LR,
                                                      "weight_decay": WEIGHT_DECAY},
        "skipped": skipped,
        "wall_s": time.time() - t_start,
        "table": txt,
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {a.out} ({time.time() - t_start:.0f} s)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
