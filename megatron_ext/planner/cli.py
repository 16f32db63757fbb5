"""``python -m megatron_ext.planner``: rank the plans for a model and cluster, print the table and the flags.

    python -m megatron_ext.planner --model llama-7b --gpus 1024 --gpus-per-node 8 \\
        --micro-batch-size 1 --global-batch-size 1024 --seq-length 4096 --hardware dgx-a100

Megatron model flags (``--num-layers --hidden-size --num-attention-heads --vocab-size ...``) may replace
``--model``; ``--profile FILE`` (written by ``tools/calibrate_comm.py``) replaces ``--hardware``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import List, Optional, Sequence, Tuple

from .cost import Workload
from .memory import TrainingSetup
from .model_spec import MODEL_PRESETS, ModelSpec, gpt_name, model_preset
from .profile import PRESETS, HardwareProfile, load_profile
from .search import DEFAULT_BUCKET_SIZES, Ranking, solve


def parse_bytes(text: str, flag: str = "--gpu-memory") -> int:
    """``80GB`` / ``80GiB`` / ``512MB`` / a plain number of bytes; both spellings mean powers of 1024 (a card's
    real memory is in the profile's ``gpu_memory_bytes``: an H100 "80GB" has 79.6 GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{flag}: cannot read {text!r} (e.g. 80GB)")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 2 ** 10, "KIB": 2 ** 10, "MB": 2 ** 20, "MIB": 2 ** 20, "GB": 2 ** 30, "GIB": 2 ** 30,
            "TB": 2 ** 40, "TIB": 2 ** 40}[unit]
    return int(float(m.group(1)) * mult)


def memory_cap(text: Optional[str], profile: HardwareProfile, flag: str = "--gpu-memory") -> int:
    """The cap a plan must fit under: what the user gave, as given, else the profile's device memory less the
    reserve for the CUDA context, NCCL and fragmentation (``profile.py``'s note [the memory cap])."""
    if text is None:
        return profile.default_memory_cap
    cap = parse_bytes(text, flag)
    if cap <= 0:
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return cap


def parse_bucket_sizes(text: str) -> List[int]:
    """``--bucket-sizes``: comma-separated element counts (``40000000`` or ``4e7``), each a whole number >= 1."""
    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--bucket-sizes: cannot read {item.strip()!r} (comma-separated element counts, "
                             "e.g. 10000000,40000000)") from None
        if not (value >= 1 and value.is_integer()):
            raise ValueError(f"--bucket-sizes: each size must be a whole number of elements >= 1, got {item.strip()!r}")
        out.append(int(value))
    return out


def _check_at_least_1(values: Sequence[Tuple[str, Optional[int]]]) -> None:
    """``(flag, value)`` pairs; a value given (not None) must be >= 1 (a count or a size: 0 has no meaning)."""
    for flag, v in values:
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model (a preset, or Megatron's model flags)")
    g.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a named shape")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups groups (default 1, as Megatron-LM)")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--kv-channels", type=int, help="default hidden size / heads")
    g.add_argument("--vocab-size", type=int, help="the padded vocabulary (as the model is built)")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, help="default --seq-length")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--qk-layernorm", action="store_true", default=None, help="a norm over each head's queries and keys")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"))
    tie = g.add_mutually_exclusive_group()
    tie.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                     help="a separate output layer. With Megatron's model flags the default is tied, as in "
                     "Megatron-LM; every --model preset is untied (LLaMA's and the seeds' GPT shapes)")
    tie.add_argument("--tie-embeddings-and-output-weights", dest="untie_embeddings_and_output_weights",
                     action="store_false", help="the output layer shares the word embedding (Megatron-LM's default; "
                     "to tie a --model preset)")


_FIELD_FLAGS = {"num_query_groups": "--num-query-groups", "position_embedding": "--position-embedding-type",
                "add_bias_linear": "--disable-bias-linear", "untie_embeddings": "--untie-embeddings-and-output-weights"}


def _flag_text(field: str, value) -> str:
    """The flag that set a ModelSpec field, as typed."""
    if field == "untie_embeddings" and not value:
        return "--tie-embeddings-and-output-weights"
    flag = _FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))
    return flag if isinstance(value, bool) else f"{flag} {value}"


def model_from_args(a: argparse.Namespace) -> ModelSpec:
    """A preset with the given Megatron flags overriding it, or a shape from the Megatron flags alone; the model
    flags checked as pretrain_gpt checks them (naming the same flags)."""
    _check_at_least_1([("--" + f.replace("_", "-"), getattr(a, f, None)) for f in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "kv_channels",
        "vocab_size", "seq_length", "max_position_embeddings")])
    if a.num_query_groups is not None and not a.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    untie = getattr(a, "untie_embeddings_and_output_weights", None)
    groups = a.num_query_groups if a.num_query_groups is not None else (1 if a.group_query_attention else None)
    fields = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                  ffn_hidden_size=a.ffn_hidden_size, num_query_groups=groups, vocab_size=a.vocab_size,
                  seq_length=a.seq_length, swiglu=a.swiglu, normalization=a.normalization,
                  position_embedding=a.position_embedding_type, kv_channels=getattr(a, "kv_channels", None),
                  max_position_embeddings=getattr(a, "max_position_embeddings", None), untie_embeddings=untie,
                  qk_layernorm=getattr(a, "qk_layernorm", None),
                  add_bias_linear=None if a.disable_bias_linear is None else not a.disable_bias_linear)
    if a.model:
        spec = model_preset(a.model, **fields)
        preset = model_preset(a.model)
        changed = [_flag_text(k, v) for k, v in fields.items()
                   if v is not None and model_preset(a.model, **{k: v}) != preset]
        if changed:   # the header says the preset was changed, not just its name
            spec = dataclasses.replace(spec, name=f"{a.model} with {' '.join(changed)}")
    else:
        fields["untie_embeddings"] = bool(untie)   # Megatron's default: input and output embeddings tied
        missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
                   if fields[f] is None]
        if missing:
            raise ValueError("give --model NAME or the Megatron model flags; missing: "
                             + ", ".join("--" + m.replace("_", "-") for m in missing))
        name = gpt_name(a.num_layers, a.hidden_size)
        spec = ModelSpec(name=name, **{k: v for k, v in fields.items() if v is not None})
    if spec.num_attention_heads % spec.query_groups:
        raise ValueError(f"--num-query-groups ({spec.query_groups}) must be positive and divide "
                         f"--num-attention-heads ({spec.num_attention_heads})")
    return spec


def check_recompute_flags(granularity: str, method: Optional[str], num_layers: Optional[int]) -> None:
    """pretrain_gpt's pairing of the recomputation flags (``--recompute-method`` and ``--recompute-num-layers``
    with full granularity only, and both needed there); the layer range is checked by ``workload_from``."""
    if granularity == "full":
        if method is None:
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
        if num_layers is None:
            raise ValueError("--recompute-granularity full needs --recompute-num-layers (layers per chunk for "
                             "uniform, layers recomputed per stage for block)")
    elif method is not None or num_layers is not None:
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        raise ValueError(f"{flag} applies to --recompute-granularity full only (got {granularity})")


def workload_from(spec: ModelSpec, *, gpus: int, gpus_per_node: int, micro_batch: int, global_batch: int,
                  tp: int = 1, pp: int = 1, recompute: str = "none", setup: TrainingSetup = TrainingSetup(),
                  sequence_parallel: bool = False, recompute_method: Optional[str] = None,
                  recompute_num_layers: Optional[int] = None) -> Workload:
    """DP size, DP ranks per node and micro-batches per step from the cluster and batch sizes (Megatron's rank
    order: TP fastest, then DP, PP outermost), after pretrain_gpt's checks of the same layout (its messages, with
    ``--gpus`` for the world size and ``--gpus-per-node`` for ``--ranks-per-node``), so that no plan is printed
    for a layout pretrain_gpt would refuse. ``recompute="full"`` without a method recomputes every layer."""
    _check_at_least_1([("--gpus", gpus), ("--gpus-per-node", gpus_per_node), ("--micro-batch-size", micro_batch),
                       ("--global-batch-size", global_batch), ("--tensor-model-parallel-size", tp),
                       ("--pipeline-model-parallel-size", pp)])
    if gpus % (tp * pp):
        raise ValueError(f"--gpus ({gpus}) is not divisible by --tensor-model-parallel-size ({tp}) x "
                         f"--pipeline-model-parallel-size ({pp})")
    if spec.num_layers % pp:
        raise ValueError(f"--num-layers ({spec.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
    if spec.num_attention_heads % tp:
        raise ValueError(f"--num-attention-heads ({spec.num_attention_heads}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if spec.num_query_groups is not None and spec.num_query_groups % tp:
        raise ValueError(f"--group-query-attention needs --num-query-groups ({spec.num_query_groups}) divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if gpus_per_node % tp:
        raise ValueError(f"--gpus-per-node ({gpus_per_node}) must be a multiple of --tensor-model-parallel-size "
                         f"({tp}): a TP group must not span nodes")
    if recompute == "full" and recompute_method is not None:
        per_stage = spec.num_layers // pp
        if recompute_num_layers is None or not 1 <= recompute_num_layers <= per_stage:
            raise ValueError("--recompute-granularity full needs --recompute-num-layers between 1 and the layers per "
                             f"pipeline stage ({per_stage}), got {recompute_num_layers}")
    dp = gpus // (tp * pp)
    rpn = max(1, min(dp, gpus_per_node // tp))
    if dp % rpn:
        raise ValueError(f"{dp} DP ranks do not fill nodes of {rpn} DP ranks (--gpus-per-node {gpus_per_node})")
    if global_batch % (micro_batch * dp):
        raise ValueError(f"--global-batch-size ({global_batch}) must be a multiple of --micro-batch-size "
                         f"({micro_batch}) x data-parallel size ({dp} = --gpus {gpus} / (TP {tp} x PP {pp}))")
    return Workload(spec, dp, rpn, micro_batch, global_batch // (micro_batch * dp), tp, pp, recompute, setup,
                    sequence_parallel=sequence_parallel, recompute_method=recompute_method,
                    recompute_num_layers=recompute_num_layers)


def format_ranking(r: Ranking, top: int) -> str:
    wl, prof = r.workload, r.profile
    lines = [f"model {wl.spec.name}: {wl.spec.num_params / 1e9:.2f}B parameters; DP {wl.dp} ({wl.ranks_per_node} "
             f"per node), TP {wl.tp}, PP {wl.pp}; {wl.micro_batches} micro-batch(es) of {wl.micro_batch} x "
             f"{wl.spec.seq_length} tokens per step; hardware {prof.name}; memory cap "
             f"{r.memory_cap / 2 ** 30:.1f} GiB; {len(r.ranked)} plans fit, {r.infeasible} over the cap",
             f"{'#':>3} {'plan':<36}{'step ms':>10}{'exposed ms':>11}{'MFU':>6}{'GiB/GPU':>9}{'x-node MiB':>11}  why"]
    for i, p in enumerate(r.ranked[:top]):
        lines.append(f"{i + 1:>3} {p.candidate.label:<36}{1e3 * p.step_s:>10.1f}{1e3 * p.exposed_s:>11.1f}"
                     f"{p.mfu(prof):>6.2f}{p.memory['total'] / 2 ** 30:>9.1f}"
                     f"{p.wire_bytes_per_node / 2 ** 20:>11.0f}  {r.reason(p)}")
    return "\n".join(lines)


def ranking_json(r: Ranking, top: int) -> dict:
    def row(p):
        return {"label": p.candidate.label, "plan": p.candidate.describe(r.workload.dp, r.workload.ranks_per_node),
                "step_s": p.step_s, "compute_s": p.compute_s, "exposed_s": p.exposed_s,
                "mfu": p.mfu(r.profile), "memory": p.memory, "wire_bytes_per_node": p.wire_bytes_per_node,
                "ledger_inter_bytes_per_node": p.inter_bytes_per_node, "flags": p.candidate.flags(),
                "reason": r.reason(p)}
    return {"hardware": r.profile.name, "memory_cap": r.memory_cap, "infeasible": r.infeasible,
            "ranked": [row(p) for p in r.ranked[:top]]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_ext.planner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    c = ap.add_argument_group("cluster and batch")
    c.add_argument("--gpus", type=int, required=True)
    c.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    c.add_argument("--gpu-memory", default=None,
                   help="memory cap per GPU, e.g. 70GB (GB and GiB both mean 2**30), taken as given. Default: the "
                   "profile's device memory less a reserve for the CUDA context and NCCL buffers (2 GiB) and "
                   "allocator fragmentation (5%%): 73.7 GiB of an H100 80GB")
    c.add_argument("--micro-batch-size", type=int, required=True)
    c.add_argument("--global-batch-size", type=int, required=True)
    c.add_argument("--tensor-model-parallel-size", type=int, default=1)
    c.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    c.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (with TP > 1): activations and norm gradients as "
                   "pretrain_gpt --sequence-parallel has them")
    c.add_argument("--recompute-granularity", choices=("none", "selective", "full"), default="none")
    c.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full recomputation: uniform (every chunk of --recompute-num-layers layers) or block (the "
                   "first --recompute-num-layers layers of each stage), as pretrain_gpt")
    c.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full recomputation: layers per chunk (uniform) or layers recomputed per stage (block)")
    c.add_argument("--params-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    h = ap.add_argument_group("hardware")
    h.add_argument("--hardware", choices=sorted(PRESETS), help="a named cluster (sources in --list-hardware)")
    h.add_argument("--profile", help="a profile JSON written by tools/calibrate_comm.py")
    h.add_argument("--list-hardware", action="store_true", help="print the presets and their sources, then exit")
    s = ap.add_argument_group("search")
    s.add_argument("--allow-quantized", action="store_true",
                   help="also search the lossy backends (qwZ, qgZ INT4/INT8, ByteGrad)")
    s.add_argument("--bucket-sizes", default=",".join(str(b) for b in DEFAULT_BUCKET_SIZES),
                   help="comma-separated bucket sizes (elements) to search")
    s.add_argument("--top", type=int, default=10, help="plans to print (>= 1)")
    s.add_argument("--json", help="also write the ranking here (its directory must exist and be writable)")
    return ap


def plan_from_args(a: argparse.Namespace) -> Ranking:
    """Check every flag (ValueError naming it), then rank the plans."""
    _check_at_least_1([("--top", getattr(a, "top", None))])
    buckets = parse_bucket_sizes(a.bucket_sizes)
    check_recompute_flags(a.recompute_granularity, a.recompute_method, a.recompute_num_layers)
    prof: HardwareProfile = load_profile(a.hardware, a.profile)
    cap = memory_cap(a.gpu_memory, prof)
    spec = model_from_args(a)
    setup = TrainingSetup(params_dtype=a.params_dtype, device=prof.device)
    wl = workload_from(spec, gpus=a.gpus,
                       gpus_per_node=a.gpus_per_node if a.gpus_per_node is not None else prof.gpus_per_node,
                       micro_batch=a.micro_batch_size, global_batch=a.global_batch_size,
                       tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
                       recompute=a.recompute_granularity, setup=setup, sequence_parallel=a.sequence_parallel,
                       recompute_method=a.recompute_method, recompute_num_layers=a.recompute_num_layers)
    return solve(wl, prof, cap, allow_quantized=a.allow_quantized, bucket_sizes=buckets)


def check_json_path(path: str) -> None:
    """``--json``: found unwritable before the search, not as a traceback after the table."""
    if os.path.isdir(path):
        raise ValueError(f"--json {path}: is a directory (give a file name)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--json {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--json {path}: not writable")


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "--list-hardware" in argv:
        for name, p in sorted(PRESETS.items()):
            print(f"{name}: {p.source}")
        return 0
    a = ap.parse_args(argv)
    try:
        if a.json:
            check_json_path(a.json)
        r = plan_from_args(a)
        best = r.best
    except ValueError as e:
        ap.error(str(e))
    print(format_ranking(r, a.top))
    print("\npretrain_gpt flags for the first plan:\n  " + " ".join(best.candidate.flags()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ranking_json(r, a.top), f, indent=1)
    return 0
