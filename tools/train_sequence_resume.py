#!/usr/bin/env python
"""Does a run saved and resumed through Megatron-LM's ``train()`` sequence log the uninterrupted run's losses, bit for
bit? The question ``tools/megatron_lm_check.sh`` check (b) asks of a real checkout on GPUs, replayed without
Megatron-LM, on CPU or one GPU.

The sequence is ``megatron/training/training.py``'s (core_v0.16.1) with ``--use-distributed-optimizer
--overlap-param-gather``, around the ODO and the plug-in's optimizer (``MegatronLMOverlappedOptimizer``):

- forward pre-hooks off for the first iteration of every run (``disable_forward_pre_hook(param_sync=False)``), on
  after its step: so a fresh run's first audited forward (``optimizer/param_sync.py``, mechanism 3) is its second
  iteration, and a resumed run's the second after the resume;
- per iteration ``zero_grad_buffer`` and ``zero_grad``, megatron-core's forward-backward schedule, ``step``;
- the legacy checkpoint split: ``disable_forward_pre_hook()``, the model's state dict, the optimizer's common
  ``state_dict`` (DP rank 0's) and ``save_parameter_state``; loading in Megatron-LM's order.

The model: a megatron-core GPT in bf16 under ``Float16Module``, with the bias-dropout-add and bias-GeLU fusions that
megatron-core compiles with ``torch.compile`` (anything that changes how the model computes after the audit shows
here). Its dropout is 0 (``build_gpt_model``), so no RNG state needs saving for the resume to be exact. Three runs, each in a fresh process (fresh compile caches, as a real resume): ``full`` (``--iters``),
``save`` (to ``--iters / 2``, then a checkpoint) and ``resume`` (from it to ``--iters``). Prints each iteration's
losses and a verdict; exit status 0 when the resumed losses equal the uninterrupted ones.

    python tools/train_sequence_resume.py                                        # CPU, a small GPT
    python tools/train_sequence_resume.py --device cuda --layers 4 --hidden 256 --seq 256 --vocab 1024 --iters 8
    python tools/train_sequence_resume.py --no-audit ...                         # the audit off (for bisecting)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

PHASES = ("full", "save", "resume")
Logged = List[Tuple[int, List[float]]]   # (iteration, each micro-batch's lm loss)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--iters", type=int, default=4, help="iterations of the uninterrupted run; the save is at half")
    p.add_argument("--bucket-size", type=int, default=3000)
    p.add_argument("--no-audit", action="store_true", help="switch the ODO's first-forward audit off")
    p.add_argument("--recompile-limit", type=int, default=None,
                   help="Dynamo's recompile limit (default: torch's); lower it to make a small model show what a "
                        "deep one would")
    p.add_argument("--out", default=None, help="checkpoint and per-run logs (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the losses and the verdict here")
    p.add_argument("--in-process", action="store_true",
                   help="the three runs in this process, Dynamo's caches reset between them (faster; the tests)")
    p.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)   # one run, in this process
    return p


def run_phase(phase: str, ckpt: str, a: argparse.Namespace) -> Logged:
    """One run in this process, with model parallelism initialised (Dynamo's caches reset first, as in a fresh
    process). Returns the logged losses."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    import megatron_ext as mx
    from megatron_ext.megatron_lm.optimizer_state import MegatronLMOverlappedOptimizer
    from megatron_ext.models.gpt import build_gpt_model, gpt_forward_step, synthetic_gpt_batch
    from megatron_ext.optimizer.megatron_config import attach_to_schedules

    torch._dynamo.reset()
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    gpt = build_gpt_model(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                          vocab_size=a.vocab, seq_length=a.seq, bf16=True, bias_dropout_fusion=True,
                          bias_activation_fusion=True)
    if a.device == "cuda":
        gpt = gpt.cuda()
    model = mx.OverlappedDDP(Float16Module(gpt.config, gpt),
                             mx.OverlapConfig(bucket_size=a.bucket_size, overlap_param_gather=True,
                                              overlap_grad_reduce=True))
    if a.no_audit:
        model.param_sync.learning = False
    opt = MegatronLMOverlappedOptimizer(OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01, clip_grad=1.0,
                                                        bf16=True), model)
    attach_to_schedules(model, opt)   # the schedule hooks, as Megatron-LM's train() sets them
    half = a.iters // 2
    start = 0
    if phase == "resume":   # Megatron-LM's order: the model, the common optimizer dict, the parameter state
        model.load_state_dict(torch.load(f"{ckpt}/model.pt", weights_only=False))
        opt.load_state_dict(torch.load(f"{ckpt}/common.pt", weights_only=False))
        opt.load_parameter_state(f"{ckpt}/distrib_optim.pt")
        start = half
    fwd_bwd = get_forward_backward_func()
    model.disable_forward_pre_hook(param_sync=False)
    logged: Logged = []
    for it in range(start, half if phase == "save" else a.iters):
        model.zero_grad_buffer()
        opt.zero_grad()
        batches = [synthetic_gpt_batch(a.micro_batch_size, a.seq, a.vocab, seed=100 * it + i)
                   for i in range(a.micro_batches)]
        if a.device == "cuda":
            batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        out = fwd_bwd(forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=[model],
                      num_microbatches=a.micro_batches, seq_length=a.seq, micro_batch_size=a.micro_batch_size,
                      forward_only=False)
        if not opt.step()[0]:
            raise RuntimeError(f"the step of iteration {it + 1} was skipped")
        if it == start:
            model.enable_forward_pre_hook()
        logged.append((it + 1, [d["lm loss"].item() for d in out]))
    if phase == "save":
        model.disable_forward_pre_hook()
        torch.save(model.state_dict(), f"{ckpt}/model.pt")
        torch.save(opt.state_dict(), f"{ckpt}/common.pt")
        opt.save_parameter_state(f"{ckpt}/distrib_optim.pt")
        model.enable_forward_pre_hook()
    return logged


def _in_world(a: argparse.Namespace, phases: Tuple[str, ...]) -> dict:
    """The given runs in this process, in a one-rank world set up here (torch.distributed.run's environment, or a
    local one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.compat import enable_cpu_compat

    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000), RANK="0",
                          WORLD_SIZE="1")
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    enable_cpu_compat()   # no-op with CUDA
    ps.initialize_model_parallel(1, 1)
    try:
        if a.recompile_limit is not None:
            torch._dynamo.config.recompile_limit = a.recompile_limit
        return {phase: run_phase(phase, a.out, a) for phase in phases}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def compare(full: Logged, resumed: Logged, half: int) -> Optional[str]:
    """None when the resumed run logged the uninterrupted run's losses after the save, bit for bit; else why not."""
    want = [(it, losses) for it, losses in full if it > half]
    if [it for it, _ in resumed] != [it for it, _ in want]:
        return f"iterations differ: resumed {[it for it, _ in resumed]}, uninterrupted {[it for it, _ in want]}"
    for (it, got), (_, exp) in zip(resumed, want):
        if got != exp:
            return f"iteration {it}: resumed {got}, uninterrupted {exp}"
    return None


def _in_fresh_processes(a: argparse.Namespace) -> Optional[dict]:
    """Each run in a fresh process (``torch.distributed.run``, one rank), as a real resume; None if one failed."""
    out = a.out
    passthrough = ["--device", a.device, "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
                   "--seq", str(a.seq), "--vocab", str(a.vocab), "--micro-batch-size", str(a.micro_batch_size),
                   "--micro-batches", str(a.micro_batches), "--iters", str(a.iters),
                   "--bucket-size", str(a.bucket_size), *(["--no-audit"] if a.no_audit else []),
                   *(["--recompile-limit", str(a.recompile_limit)] if a.recompile_limit is not None else [])]
    runs = {}
    for phase in PHASES:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", __file__,
               *passthrough, "--out", out, "--phase", phase]
        res = subprocess.run(cmd, capture_output=True, text=True)
        with open(os.path.join(out, f"{phase}.log"), "w") as f:
            f.write(res.stdout + res.stderr)
        if res.returncode:
            print(f"the {phase} run failed (exit {res.returncode}); its log: {out}/{phase}.log\n"
                  + (res.stdout + res.stderr)[-3000:], file=sys.stderr)
            return None
        with open(os.path.join(out, f"{phase}.json")) as f:
            runs[phase] = [(it, losses) for it, losses in json.load(f)]
    return runs


def _report(a: argparse.Namespace, runs: dict) -> int:
    """Print both runs' losses and the verdict (and write the JSON); the exit status."""
    runs = {k: [(it, list(losses)) for it, losses in v] for k, v in runs.items()}
    half = a.iters // 2
    resumed = {it: losses for it, losses in runs["resume"]}
    print(f"{'iteration':>9}  {'uninterrupted':<40}  resumed")
    for it, losses in runs["full"]:
        print(f"{it:>9}  {' '.join(repr(x) for x in losses):<40}  "
              f"{' '.join(repr(x) for x in resumed[it]) if it in resumed else '-'}")
    why = compare(runs["full"], runs["resume"], half)
    if why is None and runs["save"] != runs["full"][:half]:
        why = "the saving run's losses differ from the uninterrupted run's before the save"
    print(f"resume at {half} of {a.iters}: " + ("PASS (bit for bit)" if why is None else f"FAIL ({why})"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("phase", "json")}, "runs": runs,
                       "verdict": "pass" if why is None else why}, f, indent=1)
    return 0 if why is None else 1


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_args(argv)
    if a.iters < 2:
        parser().error(f"--iters must be at least 2 (the save is at --iters / 2), got {a.iters}")
    if a.phase is not None:   # worker: one run in a fresh process, its losses to OUT/PHASE.json
        with open(os.path.join(a.out, f"{a.phase}.json"), "w") as f:
            json.dump(_in_world(a, (a.phase,))[a.phase], f)
        return 0
    out = a.out = a.out or tempfile.mkdtemp(prefix="train_sequence_resume_")
    os.makedirs(out, exist_ok=True)
    runs = _in_world(a, PHASES) if a.in_process else _in_fresh_processes(a)
    if runs is None:
        return 2
    return _report(a, runs)


if __name__ == "__main__":
    sys.exit(main())
