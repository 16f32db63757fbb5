"""``pretrain_gpt --auto-plan``: the planner picks the sharding plan, backends and bucket size of this very run.

[Note: why the plan is chosen while the flags are validated]
The planner (``megatron_ext.planner``) is a pure function of the run's flags, the world size and a hardware
profile, so every rank computes the same plan with no collective. Choosing it inside ``validate_args`` means the
plan fields are in ``args`` exactly as if the user had typed the chosen candidate's flags (argparse parses the
candidate's flags into ``args`` with this project's flag definitions, and ``sharding_plan_from_args`` checks the
result as it checks typed flags), and an impossible request -- no
profile, a plan flag that contradicts ``--auto-plan``, no plan under the memory cap -- fails with a message naming
the flag before the process group, the model or the ODO exist.

The planner sees the model pretrain_gpt will build: the Megatron model flags, the vocabulary padded as
``model.padded_vocab_size`` pads it (the tokenizer's size read from its files; the default corpus's BPE is
trained to ``corpus.DEFAULT_VOCAB_SIZE`` tokens), the DP size and DP ranks per node the ODO resolves
(``--ranks-per-node`` or ``LOCAL_WORLD_SIZE``; one node without either), TP, PP, the micro-batches per step,
the params dtype, the optimizer, sequence parallelism and activation recomputation (``--recompute-granularity``,
and for full recomputation ``--recompute-method`` and ``--recompute-num-layers``: which layers keep only their
input). With pipeline parallelism the plan is sized for the stage with the most parameters, with the first
stage's activations (conservative). The default cap is the profile's device memory less a reserve for the CUDA
context, NCCL and fragmentation (``planner/profile.py``'s note [the memory cap]); ``--plan-gpu-memory`` is taken as
given.

The Megatron-LM plug-in rejects ``--auto-plan`` by name (``arguments.NOT_IN_MEGATRON_LM``): the checkout pads the
vocabulary only after parsing, and the planner may choose parameter sharding, which the plug-in does not run.
There, print a plan with ``python -m megatron_ext.planner`` and pass its flags.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Iterable, List, NoReturn, Optional, Sequence, Set, Tuple

if TYPE_CHECKING:   # the planner's modules are imported inside the functions that use them
    from megatron_ext.planner import HardwareProfile, ModelSpec, Prediction, Ranking, Workload

# Flags the planner sets, and flags that decide the plan's factors: giving one with --auto-plan is a contradiction.
# (dest, flag, the value that means "not given" when the command line itself is not known)
PLAN_FLAGS: Tuple[Tuple[str, str, object], ...] = (
    ("param_shard_size", "--param-shard-size", None),
    ("grad_shard_size", "--grad-shard-size", None),
    ("optim_shard_size", "--optim-shard-size", None),
    ("hpz_partition_size", "--hpz-partition-size", None),
    ("grad_reduce", "--grad-reduce", "plain"),
    ("param_gather", "--param-gather", "plain"),
    ("qgz_bits", "--qgz-bits", None),
    ("ddp_bucket_size", "--ddp-bucket-size", None),
)
PLANNER_FLAGS = (("plan_profile", "--plan-profile"), ("plan_hardware", "--plan-hardware"),
                 ("plan_gpu_memory", "--plan-gpu-memory"), ("plan_allow_quantized", "--plan-allow-quantized"))


def _fail(msg: str) -> NoReturn:
    from .arguments import ArgumentError   # imported here: arguments.py imports this module

    raise ArgumentError(msg)


def add_auto_plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--auto-plan`` flags (pretrain_gpt only; see the module note for the plug-in)."""
    from megatron_ext.planner.profile import PRESETS

    g = parser.add_argument_group("automatic sharding plan (megatron_ext.planner, seed 004)")
    g.add_argument("--auto-plan", action="store_true",
                   help="let the planner choose --param/--grad/--optim-shard-size, --hpz-partition-size, "
                   "--grad-reduce, --param-gather, --qgz-bits and --ddp-bucket-size for this model, batch and "
                   "cluster (the fastest predicted plan under the memory cap); rank 0 prints the choice and its "
                   "flags. Needs --plan-hardware or --plan-profile; conflicts with those plan flags")
    g.add_argument("--plan-profile", default=None, metavar="FILE",
                   help="--auto-plan: a planner hardware profile (JSON from tools/calibrate_comm.py or "
                   "HardwareProfile.save)")
    g.add_argument("--plan-hardware", default=None, choices=sorted(PRESETS),
                   help="--auto-plan: a named hardware profile (python -m megatron_ext.planner --list-hardware)")
    g.add_argument("--plan-gpu-memory", default=None, metavar="SIZE",
                   help="--auto-plan: memory cap per GPU, e.g. 70GB, taken as given (default: the profile's GPU "
                   "memory less a reserve for the CUDA context, NCCL and fragmentation: 2 GiB + 5%%)")
    g.add_argument("--plan-allow-quantized", action="store_true",
                   help="--auto-plan: also consider the lossy backends (qwZ, qgZ INT4/INT8, ByteGrad)")
    return parser


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Set[str]:
    """The ``dest`` of every flag present on the command line (argparse fills defaults only for absent ones)."""
    unset = object()
    ns = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = argparse.ArgumentParser.parse_known_args(parser, list(argv), ns)
    return {k for k, v in vars(parsed).items() if v is not unset}


def check_auto_plan_flags(args: argparse.Namespace, given: Optional[Iterable[str]] = None) -> None:
    """Flag combinations of ``--auto-plan``, before anything is derived. Raises ValueError naming the flags.

    ``given``: the dests typed on the command line; without it a plan flag counts as given when it differs from
    its default (``--grad-reduce plain`` typed explicitly is then not seen).
    """
    given_set = set(given) if given is not None else None

    def was_given(dest: str, default: object) -> bool:
        if given_set is not None:
            return dest in given_set
        return getattr(args, dest, default) != default

    if not getattr(args, "auto_plan", False):
        for dest, flag in PLANNER_FLAGS:
            if getattr(args, dest, None) not in (None, False):
                _fail(f"{flag} is an --auto-plan option: add --auto-plan, or drop {flag}")
        return
    if not args.plan_profile and not args.plan_hardware:
        _fail("--auto-plan needs a hardware profile: --plan-hardware NAME or --plan-profile FILE")
    if args.plan_profile and args.plan_hardware:
        _fail("--plan-profile and --plan-hardware conflict: give one hardware profile")
    for dest, flag, default in PLAN_FLAGS:
        if was_given(dest, default):
            _fail(f"--auto-plan conflicts with {flag}: the planner chooses {flag}; drop one of the two "
                  "(python -m megatron_ext.planner prints the ranking if you want to pick by hand)")
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if instances != 1:
        _fail(f"--auto-plan conflicts with --num-distributed-optimizer-instances {instances}: the planner "
              "chooses the optimizer shard size; drop one of the two")
    accumulate = getattr(args, "odo_accumulate", "auto") or "auto"
    if accumulate != "auto":
        _fail(f"--auto-plan conflicts with --odo-accumulate {accumulate}: the planner chooses the gradient "
              "shard size; drop one of the two")
    load_plan_profile(args)
    plan_memory_cap(args)


def load_plan_profile(args: argparse.Namespace) -> "HardwareProfile":
    """The HardwareProfile of ``--plan-profile`` / ``--plan-hardware``."""
    from megatron_ext.planner.profile import hardware_preset, HardwareProfile

    if args.plan_profile:
        try:
            return HardwareProfile.load(args.plan_profile)
        except ValueError as e:
            _fail(f"--plan-profile {e}")
    try:
        return hardware_preset(args.plan_hardware)
    except ValueError as e:
        _fail(str(e).replace("--hardware", "--plan-hardware", 1))


def plan_memory_cap(args: argparse.Namespace) -> int:
    """Bytes per GPU: ``--plan-gpu-memory`` as given, else the profile's device memory less the reserve."""
    from megatron_ext.planner.cli import memory_cap

    try:
        return memory_cap(args.plan_gpu_memory, load_plan_profile(args), "--plan-gpu-memory")
    except ValueError as e:
        _fail(str(e))


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary pretrain_gpt's tokenizer will have, read from the tokenizer's files (no data is built)."""
    from .corpus import DEFAULT_VOCAB_SIZE
    from .tokenizer import load_tokenizer

    if not (args.data_path or args.train_data_path) and not args.mock_data:
        return DEFAULT_VOCAB_SIZE
    try:
        return load_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                              merge_file=args.merge_file, vocab_size=args.vocab_size).vocab_size
    except (OSError, ValueError) as e:
        _fail(f"--auto-plan needs the tokenizer's vocabulary size: {e}")


def model_spec_from_args(args: argparse.Namespace) -> "ModelSpec":
    """The planner's ModelSpec of the GPT ``model.build_model`` builds from these (validated) flags."""
    from megatron_ext.planner.model_spec import ModelSpec, gpt_name

    from .model import padded_vocab_size

    vocab = padded_vocab_size(tokenizer_vocab_size(args), args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    return ModelSpec(
        name=gpt_name(args.num_layers, args.hidden_size), num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=vocab, seq_length=args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear, normalization=args.normalization,
        position_embedding=args.position_embedding_type,
        untie_embeddings=args.untie_embeddings_and_output_weights, kv_channels=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings, qk_layernorm=bool(getattr(args, "qk_layernorm", False)))


def workload_from_args(args: argparse.Namespace) -> "Workload":
    """DP size, DP ranks per node (as the ODO resolves them), TP, PP, batch and dtypes of this run."""
    import torch

    from megatron_ext.planner.cost import Workload
    from megatron_ext.planner.memory import TrainingSetup

    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    setup = TrainingSetup(params_dtype=dtype, optimizer=args.optimizer, quant_group_size=args.quant_group_size,
                          device="cuda" if torch.cuda.is_available() else "cpu")   # where pretrain_gpt trains
    dp = args.data_parallel_size
    rpn = args.dp_ranks_per_node or dp      # the ODO without --ranks-per-node / LOCAL_WORLD_SIZE: one node
    return Workload(model_spec_from_args(args), dp, rpn, args.micro_batch_size, args.num_micro_batches,
                    args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                    getattr(args, "recompute_granularity", None) or "none", setup,
                    sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                    recompute_method=getattr(args, "recompute_method", None),
                    recompute_num_layers=getattr(args, "recompute_num_layers", None))


def choose(args: argparse.Namespace) -> Tuple["Ranking", "Prediction"]:
    """``(ranking, best prediction)`` for this run; no plan under the cap raises naming ``--plan-gpu-memory``."""
    from megatron_ext.planner.search import format_size, solve

    wl = workload_from_args(args)
    profile = load_plan_profile(args)
    cap = plan_memory_cap(args)
    ranking = solve(wl, profile, cap, allow_quantized=args.plan_allow_quantized)
    if not ranking.ranked:
        what = ("--plan-gpu-memory" if args.plan_gpu_memory
                else f"the {profile.name} profile's GPU memory less the reserve for the CUDA context, NCCL and "
                "fragmentation; --plan-gpu-memory sets another cap")
        _fail(f"--auto-plan: no sharding plan fits in {format_size(cap)} per GPU ({what}): the leanest of "
              f"{ranking.infeasible} plans needs {format_size(ranking.leanest_bytes)}; raise --plan-gpu-memory, "
              "lower --micro-batch-size, or add tensor/pipeline parallelism or GPUs")
    return ranking, ranking.best


def apply_plan(args: argparse.Namespace, flags: List[str]) -> None:
    """Put the candidate's flags into ``args`` through the same argparse actions as a typed command line."""
    from .arguments import add_megatron_ext_args

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_megatron_ext_args(p)
    p.add_argument("--ddp-bucket-size", type=int)
    # Attributes already on args are not reset to defaults: only the candidate's flags change.
    _, extra = p.parse_known_args(flags, namespace=args)
    if extra:
        _fail(f"--auto-plan: the planner produced flags pretrain_gpt does not know: {extra}")


def summary(ranking: "Ranking", best: "Prediction", flags: List[str]) -> str:
    """The one line rank 0 prints: the plan, its predicted step time and memory, and the equivalent flags."""
    from megatron_ext.planner.search import format_size

    from .logging_utils import fmt_significant

    wl, cand = ranking.workload, best.candidate
    return (f"> auto-plan: {cand.describe(wl.dp, wl.ranks_per_node)} ({cand.label}) on {ranking.profile.name}, "
            f"DP {wl.dp} ({wl.ranks_per_node} per node): predicted step {fmt_significant(1e3 * best.step_s)} ms, "
            f"{format_size(best.memory['total'])} per GPU of {format_size(ranking.memory_cap)} "
            f"({len(ranking.ranked)} plans fit, {ranking.infeasible} over); flags: {' '.join(flags)}")


def auto_plan(args: argparse.Namespace) -> None:
    """Choose and apply the plan (``args`` already validated); sets ``args.auto_plan_summary``."""
    ranking, best = choose(args)
    flags = best.candidate.flags()
    apply_plan(args, flags)
    args.auto_plan_summary = summary(ranking, best, flags)
    args.auto_plan_label = best.candidate.label


def check_ranks_agree(args: argparse.Namespace) -> None:
    """Every rank planned alone (no collective at parse time); once the world exists, one all-reduce checks they
    chose the same plan -- a profile or tokenizer that differs between nodes would otherwise hang the first
    collective of mismatched groups. Every rank raises together."""
    import zlib

    import torch
    import torch.distributed as dist

    label = getattr(args, "auto_plan_label", None)
    if label is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from .initialize import collective_device

    h = float(zlib.crc32(label.encode()))
    t = torch.tensor([h, -h], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != -t[1].item():
        _fail(f"--auto-plan: the ranks chose different plans (this rank: {label}); --plan-profile, the tokenizer "
              "files or LOCAL_WORLD_SIZE differ between nodes: give every rank the same")
