"""Command-line flags of pretrain_gpt: Megatron-LM's names for what is supported, plus this project's own.

Parsing is strict on purpose: a Megatron-LM script that passes a flag we silently ignored would train something
other than what its author asked for. So an unknown flag, a known Megatron-LM flag this entry point does not
implement, two flags that contradict each other, and a backend that is not built yet are each an error that names
the flag (``parse_args`` exits with argparse's usage message; ``validate_args`` raises ``ArgumentError``).
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Iterable, List, Optional, Sequence

from .auto_plan import add_auto_plan_args, auto_plan, check_auto_plan_flags, given_dests
from .pipeline_layout import PipelineLayout

# Megatron-LM flags we know but do not implement: error instead of "unrecognized", with the reason.
UNSUPPORTED_MEGATRON_FLAGS = {
    "--context-parallel-size": "context parallelism is not implemented by megatron_ext.training",
    "--expert-model-parallel-size": "mixture-of-experts is not implemented by megatron_ext.training",
    "--num-experts": "mixture-of-experts is not implemented by megatron_ext.training",
    "--virtual-pipeline-model-parallel-size": "Megatron-LM's flag is --num-virtual-stages-per-pipeline-rank (or "
                                              "--num-layers-per-virtual-pipeline-stage)",
    "--use-torch-fsdp2": "the optimizer here is the OverlappedDistributedOptimizer, not FSDP2",
    "--use-custom-fsdp": "the optimizer here is the OverlappedDistributedOptimizer, not FSDP",
    "--ckpt-format": "checkpoints use megatron_ext's reshardable layout (see megatron_ext/training/checkpointing.py)",
    "--use-dist-ckpt": "checkpoints use megatron_ext's reshardable layout (see megatron_ext/training/checkpointing.py)",
    "--dataloader-type": "pretrain_gpt has one (single, resumable) data order",
    "--decrease-batch-size-if-needed": "each batch size of --rampup-batch-size must be a multiple of "
                                       "--micro-batch-size x DP already (checked with the flags)",
    "--reset-attention-mask": "per-document attention masks are not implemented: attention is causal over the "
                              "whole sequence",
    "--calculate-per-token-loss": "the loss is the token mean of each micro-batch, averaged over micro-batches",
    "--fp16-lm-cross-entropy": "the cross entropy is computed in fp32",
    "--distribute-saved-activations": "not implemented",
    "--data-args-path": "use --data-path",
    "--per-split-data-args-path": "give the paths as --train-data-path / --valid-data-path / --test-data-path",
    "--vocab-extra-ids": "a T5 option; GPT tokenizers here add no extra ids",
    "--use-checkpoint-args": "give the model flags on the command line: --load checks them against the checkpoint "
                             "and names any that differ",
    "--save-retain-interval": "every saved iteration is kept",
    "--non-persistent-save-interval": "non-persistent checkpoints are not implemented: use --save-interval",
    "--no-shared-storage": "checkpoints need a directory every rank sees (a shared filesystem)",
    "--pipeline-model-parallel-layout": "megatron-core's explicit layout string is not taken: split the layers with "
                                        "--decoder-first/last-pipeline-num-layers or "
                                        "--account-for-embedding/loss-in-pipeline-split",
    "--fp8-format": "FP8 training is not implemented",
    "--ddp-average-in-collective": "the ODO averages once, in its own reduction (the backends' one place)",
    "--use-legacy-models": "the models are megatron-core's (the legacy model code is not used)",
    "--apply-residual-connection-post-layernorm": "megatron-core 0.16's transformer layers do not implement it (the "
                                                  "TransformerConfig field is read nowhere)",
    "--recompute-modules": "selective recomputation here covers core attention only (--recompute-activations; "
                           "--recompute-modules core_attn is accepted)",
}

# Of those, the values that ask for exactly what pretrain_gpt does: scripts pasted from Megatron-LM carry them, so
# they are accepted (any other value is refused with the reason above).
NOOP_VALUES = {
    "--context-parallel-size": "1",
    "--expert-model-parallel-size": "1",
    "--dataloader-type": "single",
    "--recompute-modules": "core_attn",
}

# Megatron-LM flags that change how fast a run goes or what it logs, never what it trains: accepted, and named in a
# notice at start-up (so nothing is silently dropped). Value: (takes a value, what happens here instead).
ACCEPTED_WITHOUT_EFFECT = {
    "--use-flash-attn": (False, "attention runs through the layer spec (Transformer Engine when importable, else "
                                "megatron-core's local attention)"),
    "--attention-backend": (True, "attention runs through the layer spec (see --transformer-impl)"),
    "--no-masked-softmax-fusion": (False, "this fusion is always off here"),
    "--no-bias-gelu-fusion": (False, "this fusion is always off here"),
    "--no-bias-swiglu-fusion": (False, "this fusion is always off here"),
    "--no-bias-dropout-fusion": (False, "this fusion is always off here"),
    "--no-rope-fusion": (False, "this fusion is always off here"),
    "--no-persist-layer-norm": (False, "persistent layer norm is always off here"),
    "--cross-entropy-loss-fusion": (False, "the cross entropy is unfused"),
    "--tp-comm-overlap": (False, "Transformer Engine's tensor-parallel communication overlap is not enabled"),
    "--accumulate-allreduce-grads-in-fp32": (False, "bf16/fp16 gradients are always reduced in fp32 here"),
    "--overlap-param-gather-with-optimizer-step": (False, "the ODO overlaps its gathers with the next forward"),
    "--overlap-p2p-communication-warmup-flush": (False, "the interleaved pipeline's warm-up and flush wait for "
                                                        "their messages (megatron-core's overlap of them deadlocked "
                                                        "on gloo here)"),
    "--no-align-grad-reduce": (False, "each model chunk's reduce-scatters start from its own backward"),
    "--no-align-param-gather": (False, "every chunk's all-gathers start right after the step"),
    "--no-create-attention-mask-in-dataloader": (False, "the dataloader never builds masks here"),
    "--async-save": (False, "checkpoints are saved synchronously"),
    "--ckpt-fully-parallel-save": (False, "every rank writes its own files already"),
    "--manual-gc": (False, "Python's garbage collector runs as usual"),
    "--manual-gc-interval": (True, "Python's garbage collector runs as usual"),
    "--num-workers": (True, "batches are read in the training process"),
    "--mmap-bin-files": (False, "megatron-core's default (memory-mapped .bin files)"),
    "--no-mmap-bin-files": (False, "the .bin files are memory-mapped"),
    "--num-dataset-builder-threads": (True, "datasets are built in one thread"),
    "--empty-unused-memory-level": (True, "the caching allocator is not emptied"),
    "--deterministic-mode": (False, "CPU runs are deterministic; on GPUs the default kernels run"),
    "--log-throughput": (False, "every log line shows throughput"),
    "--timing-log-level": (True, "timers are not logged"),
    "--tensorboard-log-interval": (True, "TensorBoard scalars are written every --log-interval"),
    "--tensorboard-queue-size": (True, "TensorBoard's default queue"),
    "--log-validation-ppl-to-tensorboard": (False, "validation perplexity is printed"),
    "--log-memory-to-tensorboard": (False, "memory is not logged"),
    "--log-world-size-to-tensorboard": (False, "the world size is printed in the arguments"),
    "--log-straggler": (False, "stragglers are not detected"),
    "--wandb-project": (True, "Weights & Biases logging is not implemented (use --tensorboard-dir)"),
    "--wandb-exp-name": (True, "Weights & Biases logging is not implemented (use --tensorboard-dir)"),
    "--wandb-save-dir": (True, "Weights & Biases logging is not implemented (use --tensorboard-dir)"),
    "--no-query-key-layer-scaling": (False, "query-key layer scaling is off here (megatron-core's default)"),
    "--create-attention-mask-in-dataloader": (False, "the dataloader never builds masks here"),
    "--log-loss-scale-to-tensorboard": (False, "the loss scale is always written to TensorBoard"),
    "--no-save-rng": (False, "checkpoints hold the RNG states"),
}


def ignored_flag_notice(args: argparse.Namespace) -> Optional[str]:
    """The start-up line that names the flags of :data:`ACCEPTED_WITHOUT_EFFECT` this run was given, or None."""
    given = [flag for flag in ACCEPTED_WITHOUT_EFFECT
             if getattr(args, flag.lstrip("-").replace("-", "_"), None) not in (None, False)]
    if not given:
        return None
    return "> accepted without effect: " + "; ".join(f"{f} ({ACCEPTED_WITHOUT_EFFECT[f][1]})" for f in given)


class ArgumentError(ValueError):
    """A flag or flag combination that cannot work; the message names the flag(s)."""


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = self.parse_known_args(args, namespace)
        extra = _drop_noop_values(extra)
        if extra:
            self.error(_explain_unknown(extra, self))
        return ns

    def error(self, message: str):  # type: ignore[override]
        """The error alone (argparse's usage of some 200 flags buried it), printed once per node: by local rank 0
        under torchrun (the flags and the node's files are the same for every rank there), exit status 2 on all.

        Under torchrun the first rank to exit has the agent stop the others, so a quiet rank that exited first could
        stop local rank 0 before it printed (the error was then lost now and then): the quiet ranks wait for local
        rank 0's exit to stop them, at most ``QUIET_RANK_WAIT_S``."""
        if os.environ.get("LOCAL_RANK", "0") != "0":
            if os.environ.get("TORCHELASTIC_RUN_ID"):
                _wait_for_local_rank_0(QUIET_RANK_WAIT_S)
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the flags)\n")


QUIET_RANK_WAIT_S = 30.0


def _wait_for_local_rank_0(seconds: float) -> None:
    import time

    time.sleep(seconds)


def _drop_noop_values(extra: Sequence[str]) -> List[str]:
    """``extra`` without the :data:`NOOP_VALUES` flags at their no-op value (``--flag value`` or ``--flag=value``)."""
    out, i = [], 0
    while i < len(extra):
        flag, eq, value = extra[i].partition("=")
        if flag in NOOP_VALUES:
            if not eq and i + 1 < len(extra):
                value = extra[i + 1]
            if value == NOOP_VALUES[flag]:
                i += 1 if eq else 2
                continue
        out.append(extra[i])
        i += 1
    return out


def _explain_unknown(extra: Sequence[str], parser: argparse.ArgumentParser) -> str:
    known = [o for a in parser._actions for o in a.option_strings]
    msgs = []
    prev_flag = False
    for tok in extra:
        if not tok.startswith("-"):
            if not prev_flag:  # values of an unknown flag are not worth a message of their own
                msgs.append(f"unexpected value {tok!r}")
            continue
        prev_flag = True
        flag = tok.split("=", 1)[0]
        if flag in UNSUPPORTED_MEGATRON_FLAGS:
            msgs.append(f"{flag} is a Megatron-LM flag that pretrain_gpt does not support: "
                        f"{UNSUPPORTED_MEGATRON_FLAGS[flag]}"
                        + (f" (only {flag} {NOOP_VALUES[flag]} is accepted)" if flag in NOOP_VALUES else ""))
        else:
            close = difflib.get_close_matches(flag, known, n=1)
            msgs.append(f"unrecognized argument {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(msgs)


def _tokenizer_hint(data_path) -> str:
    """The flags for the tokenizer tools/preprocess_data.py trained beside ``--data-path``'s first prefix, if any."""
    paths = [x for x in (data_path if isinstance(data_path, (list, tuple)) else [data_path])
             if isinstance(x, str) and not x.replace(".", "", 1).isdigit()]
    for prefix in paths[:1]:
        trained = prefix[:-len("_text_document")] + "_tokenizer.json" if prefix.endswith("_text_document") else None
        if trained and os.path.exists(trained):
            return f": --tokenizer-type HuggingFaceTokenizer --tokenizer-model {trained} (written by " \
                   "tools/preprocess_data.py --train-tokenizer-vocab-size)"
    return ": e.g. --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER.json, or GPT2BPETokenizer " \
           "--vocab-file --merge-file"


def _qgz_stages(value: str):
    """``--qgz-pipeline-stages``: a positive integer or ``auto`` (argparse names the flag on error)."""
    if value == "auto":
        return value
    try:
        stages = int(value)
    except ValueError:
        stages = 0
    if stages < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {value!r}")
    return stages


def qgz_stages_config(args: argparse.Namespace) -> dict:
    """``OverlapConfig`` keyword for ``--qgz-pipeline-stages`` (none when unset: the config's default)."""
    stages = getattr(args, "qgz_pipeline_stages", None)
    if stages is None:
        return {}
    return {"qgz_pipeline_stages": None if stages == "auto" else int(stages)}


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This project's flags; shared by pretrain_gpt and the Megatron-LM plug-in's extra_args_provider."""
    g = parser.add_argument_group("megatron-ext (OverlappedDistributedOptimizer and communication backends)")
    g.add_argument("--use-overlapped-distributed-optimizer", action="store_true",
                   help="shard optimizer state and gradients with the ODO (pretrain_gpt always does)")
    g.add_argument("--odo-accumulate", choices=("auto", "shard", "local"), default="auto",
                   help="gradient accumulation: reduce-scatter every micro-batch (shard), once per step (local), "
                   "or pick the cheaper (auto)")
    g.add_argument("--grad-reduce", choices=("plain", "qgz", "bytegrad", "ring"), default="plain",
                   help="gradient reduce-scatter backend (ring: NCCL's ring as point-to-point hops, for gloo, whose "
                        "reduce-scatter sends an all-reduce's bytes)")
    g.add_argument("--param-gather", choices=("plain", "qwz"), default="plain", help="parameter all-gather backend")
    g.add_argument("--qgz-bits", type=int, choices=(4, 8), default=None, help="qgZ gradient bits (default 4)")
    g.add_argument("--qgz-pipeline-stages", type=_qgz_stages, default=None, metavar="{N,auto}",
                   help="qgZ: chunks of a bucket whose intra- and inter-node hops are pipelined (default 2); auto: 1 "
                   "when the progress engine runs and there are at least 4 buckets (consecutive buckets already "
                   "keep both links busy, and each stage costs a pair of all-to-alls per bucket), else 2")
    g.add_argument("--quant-group-size", type=int, default=None,
                   help="elements per quantization scale for qwZ/qgZ (default 2048)")
    g.add_argument("--odo-progress-engine", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress engine issues, advances and completes the gradient reductions' hops and "
                   "epilogues while forward and backward run: a thread on CPU, inline on the communication stream "
                   "on CUDA with NCCL (default: on, unless MEGATRON_EXT_PROGRESS_ENGINE=0); "
                   "--no-odo-progress-engine: the synchronous path")
    g.add_argument("--odo-speculative-step", action="store_true",
                   help="step each bucket and start its weight gather in backward, as soon as its gradient is "
                   "reduced, assuming global clipping leaves the step alone; undone and redone bit for bit when it "
                   "does not (costs a second gather then, and 12 bytes per parameter / DP size for the undo copy). "
                   "Hides the weight gathers behind the backward on slow links; ZeRO-1/2 on CPU, not with --fp16; "
                   "needs --overlap-grad-reduce --overlap-param-gather")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node for the intra/inter-node split (default: LOCAL_WORLD_SIZE); smaller than "
                   "the world size simulates several nodes on one machine")
    g.add_argument("--hpz-partition-size", type=int, default=None,
                   help="hpZ (ZeRO++): after forward keep a 1/N secondary piece of the sharded weights inside a "
                   "node-local group of N ranks, so the backward gathers never cross nodes; needs "
                   "--param-shard-size > 1 (DeepSpeed's zero_hpz_partition_size)")
    g.add_argument("--param-shard-size", type=int, default=None,
                   help="sharding plan: DP ranks a parameter is sharded over (1: full weights on every rank; > 1: "
                   "ZeRO-3, with --grad-shard-size and --optim-shard-size equal to it or unset)")
    g.add_argument("--grad-shard-size", type=int, default=None,
                   help="sharding plan: DP ranks the accumulated gradient is sharded over, 1 (accumulate full "
                   "gradients, reduce once per step) or --optim-shard-size (reduce-scatter every micro-batch); "
                   "default: --odo-accumulate")
    g.add_argument("--optim-shard-size", type=int, default=None,
                   help="sharding plan: DP ranks the optimizer states are sharded over, replicated across those "
                   "groups (default: the whole DP group; ranks per node: node-local, parameters gathered inside "
                   "the node)")
    g.add_argument("--ladder-residual", action="store_true", help="Ladder Residual transformer layers")
    g.add_argument("--ladder-residual-layers", type=int, default=None, help="ladder on the last N layers only")
    g.add_argument("--desync-residual", choices=("2x", "4x"), default=None, help="Desynced Residual pattern")
    return parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt", allow_abbrev=False,
                description="Pretrain a megatron-core GPT model with the OverlappedDistributedOptimizer "
                "(Megatron-LM flag names). Launch with torchrun; without --data-path it trains on a cached corpus "
                "built from the Python standard library's sources.")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4 * hidden size; with --swiglu 2/3 of that, rounded down to a multiple of 64 "
                   "(Megatron-LM's rule)")
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden size / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="with --group-query-attention (default 1, as in Megatron-LM)")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true", help="squared ReLU activation (instead of GeLU)")
    g.add_argument("--qk-layernorm", action="store_true", help="normalise queries and keys per head")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred layer-norm gamma (needs --transformer-impl transformer_engine)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="softmax in fp32 (always on with --bf16/--fp16 here)")
    g.add_argument("--init-method-xavier-uniform", action="store_true",
                   help="Xavier-uniform initialisation of the linear weights (instead of --init-method-std)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type none (rope when combined with "
                   "--use-rotary-position-embeddings)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="layer implementation (default: transformer_engine when importable, else local)")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted; models are always megatron-core's")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialise weights on CPU (always on without CUDA; makes TP>1 init equal TP=1's)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recomputation (core attention), as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute whole layers in backward (with --recompute-method and "
                   "--recompute-num-layers); selective: core attention only")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full recomputation: uniform (every chunk of --recompute-num-layers layers) or block (the "
                   "first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full recomputation: layers per chunk (uniform) or layers recomputed per stage (block)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true",
                   help="accepted: the fused weight-gradient accumulation is always off (it writes main_grad, which "
                   "the ODO does not keep)")

    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch size * DP")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline: transformer layers per model chunk (each stage holds "
                   "layers / PP / this chunks)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="interleaved pipeline: model chunks per pipeline stage")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="uneven pipeline: transformer layers of the first stage (the other stages split the rest "
                   "evenly; megatron-core's rule)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="uneven pipeline: transformer layers of the last stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer of the first stage when splitting the layers")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as one layer of the last stage when splitting the layers")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="interleaved pipeline: consecutive micro-batches a chunk runs before the next chunk (default "
                   "--pipeline-model-parallel-size)")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="interleaved pipeline: batch the stage-to-stage sends and receives instead of overlapping "
                   "them with compute (needs --pipeline-model-parallel-size > 2, as in Megatron-LM); the plain "
                   "pipeline always batches them")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-model-parallel-size > 1; needs --transformer-impl transformer_engine")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and output layer (a param group of their own)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the embedding and output layer (default --min-lr; needs "
                   "--decoupled-lr)")
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="weight decay on the q/k layernorm weights too (other 1-D parameters and biases get none)")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                   default="linear", help="WSD: warmup, stable, then a decay over the last --lr-wsd-decay-iters")
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                   default="exponential", help="the decay of WSD's last phase")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="iterations of WSD's decay phase")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="samples of WSD's decay phase (with --train-samples)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default --train-samples")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm up over this fraction of the decay (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler", action="store_true",
                   help="on --load, take the LR/weight-decay schedule from these flags, not from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler", action="store_true",
                   help="on --load, take the LR/weight-decay schedule from the checkpoint, not from these flags "
                   "(default: neither, and a schedule flag that differs from the checkpoint is an error)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="with a non-constant --weight-decay-incr-style: weight decay at the start")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="with a non-constant --weight-decay-incr-style: weight decay at --train-iters")
    g.add_argument("--weight-decay-incr-style", choices=("constant", "linear", "cosine"), default="constant")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="default 2**32")
    g.add_argument("--min-loss-scale", type=float, default=None, help="default 1.0")
    g.add_argument("--loss-scale-window", type=int, default=None, help="default 1000")
    g.add_argument("--hysteresis", type=int, default=None, help="default 2")

    g = p.add_argument_group("distributed optimizer (Megatron-LM names)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="megatron-core's partial distributed optimizer: K replicas of optimizer states and "
                   "gradients, i.e. --grad-shard-size = --optim-shard-size = DP / K")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="accepted: the ODO is a distributed (sharded) optimizer")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="on by default, as in Megatron-LM: stop with an error, on every rank, when "
                   "the gradient norm is not finite, before the step changes any weight (fp16 skips such steps "
                   "anyway)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="train on through non-finite gradient norms (Megatron-LM's flag)")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="elements per bucket "
                   "(default max(40M, 1M * DP), like megatron-core)")
    add_megatron_ext_args(p)
    add_auto_plan_args(p)

    g = p.add_argument_group("Megatron-LM flags accepted without effect (named in a notice at start-up)")
    for flag, (takes_value, why) in ACCEPTED_WITHOUT_EFFECT.items():
        if takes_value:
            g.add_argument(flag, default=None, metavar="VALUE", help=f"accepted: {why}")
        else:
            g.add_argument(flag, action="store_true", default=None, help=f"accepted: {why}")

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=None,
                   help="iterations to train (or --train-samples; the schedule flags then count the same unit)")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: start at global batch START and raise it by INCREMENT, evenly over "
                        "SAMPLES samples, up to --global-batch-size (Megatron-LM's ramp-up)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train, as Megatron-LM: --train-samples // --global-batch-size iterations, with "
                        "the schedule in samples (--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the fp32 master weights (Megatron-LM's 'params norm')")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the zeros in the last step's gradient (Megatron-LM's 'num zeros')")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--tensorboard-dir", default=None,
                   help="the last rank writes each log line's values (lm loss, learning-rate, grad-norm, loss-scale, "
                   "iteration-time, bytes-per-step/intra-node and inter-node) and the validation and test losses as "
                   "TensorBoard scalars, Megatron-LM's tags (needs the tensorboard package)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="accepted for compatibility")
    g.add_argument("--exit-interval", type=int, default=None, help="exit after the iteration that is a multiple")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (e.g. Slurm's --signal before the time limit), save (with --save) and exit after "
                   "the iteration in progress")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit after the first iteration that ends past this many minutes "
                   "of the run (decided by the slowest rank)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es), optionally weighted: 'w1 p1 w2 p2'; default: the cached "
                   "standard-library corpus")
    g.add_argument("--split", default="969,30,1")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="+", default=None,
                       help=f"the {split} split's own prefix(es), optionally weighted (Megatron-LM's per-split data; "
                            "instead of --data-path and --split)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each end-of-document token")
    g.add_argument("--tokenizer-type", choices=("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
                   default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--data-cache-path", default=None)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="with --load: resume from this iteration's checkpoint instead of the one the tracker names "
                   "(as Megatron-LM; the tracker is left as it is)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with an error when there is no checkpoint to load (also when --load is "
                   "--save)")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: load the model weights only and start at iteration 0 with a fresh optimizer, "
                   "learning-rate schedule, data position and RNG (as Megatron-LM; so a restarted job with "
                   "--finetune and --load = --save starts over from its own last checkpoint: drop --finetune to "
                   "resume)")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: with --load, evaluate the checkpoint on the validation and test sets "
                   "(--eval-iters batches each) and stop, saving nothing (as Megatron-LM)")
    return p


def parse_args(argv: Optional[List[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; exits with a message naming the offending flag, like argparse."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = given_dests(parser, sys.argv[1:] if argv is None else argv)
    try:
        validate_args(args, world_size, given=given)
    except ArgumentError as e:
        parser.error(str(e))
    return args


def _fail(msg: str) -> None:
    raise ArgumentError(msg)


def _warn(msg: str) -> None:
    """A warning about the flags, once per job: every rank validates them, global rank 0 (torchrun's RANK) says it."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"WARNING: {msg}", file=sys.stderr)


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None,
                  given: Optional[Iterable[str]] = None) -> argparse.Namespace:
    """Check flag combinations and fill derived values (``data_parallel_size`` ...). Raises ArgumentError.

    ``given``: dests typed on the command line (``parse_args`` passes them), so that ``--auto-plan`` can tell a
    plan flag typed with its default value from one left out. With ``--auto-plan`` the planner's choice is put into
    ``args`` last, as if typed (``auto_plan.py``).
    """
    import torch

    world_size = int(world_size if world_size is not None else _env_world_size())
    args.world_size = world_size
    check_auto_plan_flags(args, given)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--micro-batch-size", args.micro_batch_size),
                    ("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                    ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length),
                    ("--log-interval", args.log_interval), ("--eval-interval", args.eval_interval),
                    ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by)):
        if v <= 0:
            _fail(f"{flag} must be positive, got {v}")
    unit = _training_length_unit(args)
    if world_size % (tp * pp) != 0:
        _fail(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
              f"--pipeline-model-parallel-size ({pp})")
    args.data_parallel_size = dp = world_size // (tp * pp)
    if not pipeline_layout(args, pp, 1).even and getattr(args, "auto_plan", False):
        _fail("--auto-plan plans even pipeline stages: drop --decoder-first/last-pipeline-num-layers and "
              "--account-for-embedding/loss-in-pipeline-split, or --auto-plan")
    if args.num_attention_heads % tp != 0:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        _fail(f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
              f"({args.num_attention_heads}) unless --kv-channels is given")
    if args.num_query_groups is not None and not args.group_query_attention:
        _fail("--num-query-groups needs --group-query-attention")
    if args.group_query_attention:
        if args.num_query_groups is None:
            args.num_query_groups = 1   # Megatron-LM's default
        if args.num_query_groups <= 0 or args.num_attention_heads % args.num_query_groups != 0:
            _fail(f"--num-query-groups ({args.num_query_groups}) must be positive and divide "
                  f"--num-attention-heads ({args.num_attention_heads})")
        if args.num_query_groups % tp != 0:
            _fail(f"--group-query-attention needs --num-query-groups ({args.num_query_groups}) divisible by "
                  f"--tensor-model-parallel-size ({tp})")
    if args.ffn_hidden_size is None:
        from megatron_ext.planner.model_spec import default_ffn_hidden_size

        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
        if args.ffn_hidden_size <= 0:
            _fail(f"--swiglu at --hidden-size {args.hidden_size} gives Megatron-LM's default FFN size 0 (2/3 of 4h "
                  "rounded down to a multiple of 64): pass --ffn-hidden-size")
    for flag, v in (("--ffn-hidden-size", args.ffn_hidden_size), ("--kv-channels", args.kv_channels)):
        if v is not None and v <= 0:
            _fail(f"{flag} must be positive, got {v}")
    for flag, v in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= v <= 1.0:
            _fail(f"{flag} must be in [0, 1], got {v}")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    elif args.no_position_embedding:
        args.position_embedding_type = "none"
    if args.swiglu and args.squared_relu:
        _fail("--swiglu and --squared-relu conflict: choose one activation")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
        _fail(f"--max-position-embeddings ({args.max_position_embeddings}) is smaller than --seq-length "
              f"({args.seq_length})")

    _validate_virtual_pipeline(args, pp)
    _validate_recompute(args, pp)

    # Batch.
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size <= 0:
        _fail(f"--global-batch-size must be positive, got {args.global_batch_size}")
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        _fail(f"--global-batch-size ({args.global_batch_size}) must be a multiple of --micro-batch-size "
              f"({args.micro_batch_size}) x data-parallel size ({dp} = world {world_size} / (TP {tp} x PP {pp}))")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.rampup_batch_size is not None:   # Megatron-LM's update_train_iters, with the ramp or without
        from .batch_size import rampup_problems, rampup_train_iters

        problem = rampup_problems(args)
        if problem:
            _fail(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: {problem}")
        args.train_iters = rampup_train_iters(args)
    elif unit == "samples":
        args.train_iters = args.train_samples // args.global_batch_size
    if args.train_iters == 0 and not args.skip_train:
        _fail(f"--train-samples ({args.train_samples}) is less than one --global-batch-size "
              f"({args.global_batch_size}): no iteration to train")
    if args.virtual_pipeline_model_parallel_size is not None:
        _check_interleaved_micro_batches(args, pp)
        if args.rampup_batch_size is not None:   # every batch of the ramp is scheduled the same way
            from .batch_size import ramp_sizes

            for batch in ramp_sizes(args)[:-1]:
                _check_interleaved_micro_batches(args, pp, batch)
        if args.microbatch_group_size_per_vp_stage is None:
            args.microbatch_group_size_per_vp_stage = pp
    elif pp > 1 and args.num_micro_batches < pp:
        # megatron-core's 1F1B schedule runs with fewer micro-batches than stages, but it is all bubble.
        _warn(f"{args.num_micro_batches} micro-batches per step with {pp} pipeline stages: the pipeline "
              "is mostly idle; raise --global-batch-size")

    if args.sequence_parallel and tp == 1:
        _warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled")
        args.sequence_parallel = False

    # Precision.
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 conflict: choose one")
    fp16_only = [f"--{flag.replace('_', '-')}" for flag in ("loss_scale", "initial_loss_scale", "min_loss_scale",
                                                            "loss_scale_window", "hysteresis")
                 if getattr(args, flag) is not None]
    if fp16_only and not args.fp16:   # Megatron-LM ignores them too; scripts carry them beside --bf16
        _warn(f"ignored without --fp16 (as in Megatron-LM): {', '.join(fp16_only)}")
    elif args.fp16:
        for flag in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window"):
            v = getattr(args, flag)
            if v is not None and v <= 0:
                _fail(f"--{flag.replace('_', '-')} must be positive, got {v}")
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32

    # Optimizer and schedule, in the training length's unit (iterations or samples).
    total, decay, warmup, wsd = (f"train_{unit}", f"lr_decay_{unit}", f"lr_warmup_{unit}", f"lr_wsd_decay_{unit}")
    flag = {k: "--" + k.replace("_", "-") for k in (total, decay, warmup, wsd)}
    decay_default = getattr(args, decay) is None
    if decay_default:
        setattr(args, decay, getattr(args, total))
    if getattr(args, decay) <= 0:
        _fail(f"{flag[decay]} must be positive, got {getattr(args, decay)}")
    if getattr(args, warmup) < 0:
        _fail(f"{flag[warmup]} must be >= 0, got {getattr(args, warmup)}")
    if args.lr_warmup_fraction is not None:
        if getattr(args, warmup):
            _fail(f"--lr-warmup-fraction and {flag[warmup]} conflict: choose one")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            _fail(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    if getattr(args, warmup) >= getattr(args, decay):
        _fail(f"{flag[warmup]} ({getattr(args, warmup)}) must be smaller than {flag[decay]} "
              f"({getattr(args, decay)}{', by default ' + flag[total] if decay_default else ''})")
    if args.lr_decay_style == "WSD":
        if getattr(args, wsd) is None:
            _fail(f"--lr-decay-style WSD needs {flag[wsd]} (the {'iterations' if unit == 'iters' else unit} of its "
                  "final decay)")
        if not 0 < getattr(args, wsd) <= getattr(args, decay):
            _fail(f"{flag[wsd]} ({getattr(args, wsd)}) must be in [1, {flag[decay]} ({getattr(args, decay)})]")
    elif getattr(args, wsd) is not None:
        _warn(f"{flag[wsd]} is ignored: --lr-decay-style is {args.lr_decay_style}, not WSD")
    if args.lr < 0 or args.min_lr < 0:
        _fail(f"--lr ({args.lr}) and --min-lr ({args.min_lr}) must be >= 0")
    if args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        _fail("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's own schedule)")
    if args.decoupled_lr is not None:
        dmin = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if args.decoupled_lr < 0 or dmin < 0:
            _fail(f"--decoupled-lr ({args.decoupled_lr}) and --decoupled-min-lr ({dmin}) must be >= 0")
        if dmin > args.decoupled_lr:
            _fail(f"the embedding and output layer's minimum learning rate ({dmin}, --decoupled-min-lr or "
                  f"--min-lr) is larger than --decoupled-lr ({args.decoupled_lr})")
    if args.weight_decay_incr_style == "constant":
        for flag, v in (("--start-weight-decay", args.start_weight_decay), ("--end-weight-decay",
                                                                           args.end_weight_decay)):
            if v is not None:
                _fail(f"{flag} needs --weight-decay-incr-style linear or cosine (constant uses --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        _fail(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
              "--end-weight-decay")
    for flag, v in (("--weight-decay", args.weight_decay), ("--start-weight-decay", args.start_weight_decay),
                    ("--end-weight-decay", args.end_weight_decay), ("--clip-grad", args.clip_grad)):
        if v < 0:
            _fail(f"{flag} must be >= 0, got {v}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler conflict: choose one")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        _fail("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if args.ddp_bucket_size is None:
        args.ddp_bucket_size = max(40_000_000, 1_000_000 * dp)
    if args.ddp_bucket_size <= 0:
        _fail(f"--ddp-bucket-size must be positive, got {args.ddp_bucket_size}")
    args.use_overlapped_distributed_optimizer = True  # the only DP optimizer of this entry point
    args.use_distributed_optimizer = True             # (a sharded one: the arguments table says so)
    _validate_backends(args)
    _validate_later_features(args)

    # Data and tokenizer.
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if any(per_split):
        if args.data_path or args.mock_data:
            _fail(f"{'--data-path' if args.data_path else '--mock-data'} conflicts with --train-data-path / "
                  "--valid-data-path / --test-data-path: give one blend split by --split, or one per split")
        if not args.train_data_path:
            _fail("--valid-data-path / --test-data-path need --train-data-path (the data to train on)")
        if "split" in set(given or ()):
            _warn(f"--split {args.split} is ignored: with --train-data-path each split reads its own files whole")
    data = args.data_path or args.train_data_path
    if args.mock_data and args.data_path:
        _fail("--mock-data conflicts with --data-path")
    if args.mock_data and args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer"
        args.vocab_size = args.vocab_size or 1024
    if data and args.tokenizer_type is None:
        _fail(f"{'--data-path' if args.data_path else '--train-data-path'} needs --tokenizer-type (the tokenizer the "
              "data was preprocessed with)" + _tokenizer_hint(data))
    if not data and not args.mock_data and args.tokenizer_type is not None:
        _fail("--tokenizer-type without --data-path: the default corpus brings its own tokenizer")
    unused = [f for f, v in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                             ("--tokenizer-model", args.tokenizer_model)) if v is not None]
    if unused and args.tokenizer_type is None:
        _fail(f"{' and '.join(unused)} without --tokenizer-type: name the tokenizer they belong to (and the "
              "--data-path it tokenized)")
    if args.tokenizer_type == "NullTokenizer" and (args.vocab_size is None or args.vocab_size < 1):
        _fail(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got {args.vocab_size})")
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        # Megatron-LM accepts the flag and ignores it for every other tokenizer; say so instead of staying silent.
        _warn(f"--vocab-size {args.vocab_size} is ignored: only --tokenizer-type NullTokenizer reads it; "
              f"the vocabulary size comes from the tokenizer ({args.tokenizer_type or 'the default corpus'})")
    try:
        from .data import check_data_path, check_per_split_paths, parse_split

        parse_split(args.split)
    except ValueError as e:
        _fail(str(e))
    if args.tokenizer_type in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):   # a bad file fails here, on every rank
        from .tokenizer import load_tokenizer

        try:
            load_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                           merge_file=args.merge_file)
        except (ValueError, OSError) as e:
            _fail(str(e))
    if data and not args.mock_data:   # the files and splits now, not after the process group started
        try:
            args.data_notice = (check_data_path(args.data_path, args.split, max(args.eval_iters, 0)) if args.data_path
                                else check_per_split_paths(per_split, max(args.eval_iters, 0)))
        except (ValueError, OSError) as e:
            _fail(str(e))
        except AssertionError as e:   # megatron-core's IndexedDataset on a corrupt .idx (per-split: named there)
            _fail(f"--data-path {' '.join(map(str, data))}: an index file is not a megatron-core .idx ({e})")

    # Evaluation and exit.
    if args.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0 (0: no evaluation), got {args.eval_iters}")
    if args.exit_interval is not None and args.exit_interval <= 0:
        _fail(f"--exit-interval must be positive, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        _fail(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")

    # Checkpoints.
    if args.skip_train and args.eval_iters <= 0:
        _fail("--skip-train evaluates only, and --eval-iters 0 turns evaluation off: nothing would run")
    if args.skip_train and args.train_data_path and not (args.valid_data_path or args.test_data_path):
        _fail("--skip-train evaluates only, and without --valid-data-path or --test-data-path there is nothing to "
              "evaluate")
    if args.finetune and not args.load:
        _fail("--finetune needs --load (the checkpoint whose weights to start from)")
    if args.ckpt_step is not None and not args.load:
        _fail("--ckpt-step needs --load (the directory holding that iteration's checkpoint)")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        _fail(f"--ckpt-step must be at least 0, got {args.ckpt_step}")
    if args.save_interval is not None and not args.save:
        _fail("--save-interval needs --save")
    if args.save_interval is not None and args.save_interval <= 0:
        _fail(f"--save-interval must be positive, got {args.save_interval}")
    if args.save:
        _check_save_dir(args.save)
    if args.load:
        _check_load_dir(args)
    te_available = _importable("transformer_engine")
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te_available else "local"
    if args.transformer_impl == "transformer_engine" and not te_available:
        _fail("--transformer-impl transformer_engine: transformer_engine is not importable; use local")
    if args.desync_residual and args.tensor_model_parallel_size > 1 and args.transformer_impl == "transformer_engine":
        _fail("--desync-residual at --tensor-model-parallel-size > 1 needs --transformer-impl local: "
              "transformer-engine fuses the norm into linear_qkv, so the per-rank norm-weight gradients cannot be "
              "summed over the TP group")
    if args.apply_layernorm_1p and args.transformer_impl == "local":
        _fail("--apply-layernorm-1p needs --transformer-impl transformer_engine: megatron-core's local layer spec "
              "(torch norms) has no zero-centred gamma")
    if args.sequence_parallel and args.transformer_impl == "local":
        _fail("--sequence-parallel needs --transformer-impl transformer_engine: megatron-core's local layer spec "
              "(WrappedTorchNorm) rejects sequence parallelism")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        _fail("--distributed-backend nccl needs CUDA; use gloo on CPU")
    if getattr(args, "auto_plan", False):
        auto_plan(args)
        _check_planned_backends(args)
        sharding_plan_from_args(args, args.data_parallel_size, args.dp_ranks_per_node)
    if args.odo_speculative_step:
        if args.fp16:
            _fail("--odo-speculative-step does not work with --fp16 (the loss scaler's overflow check is global like "
                  "the clipping norm); use --bf16")
        if (args.param_shard_size or 1) > 1:
            _fail("--odo-speculative-step needs ZeRO-1/2 (--param-shard-size 1): ZeRO-3 gathers each bucket at its "
                  "forward anyway")
        if torch.cuda.is_available():
            _fail("--odo-speculative-step runs on CPU (gloo) in this version")
        if not (args.overlap_grad_reduce and args.overlap_param_gather):
            _fail("--odo-speculative-step needs --overlap-grad-reduce and --overlap-param-gather")
    return args


def _check_planned_backends(args: argparse.Namespace) -> None:
    from megatron_ext.comm import available_grad_reduce, available_param_gather

    for flag, name, available in (("--grad-reduce", args.grad_reduce, available_grad_reduce()),
                                  ("--param-gather", args.param_gather, available_param_gather())):
        if name not in available:
            _fail(f"--auto-plan chose {flag} {name}, which is not implemented in this build "
                  f"(available: {', '.join(available)})")


def _quant_group_notice(args: argparse.Namespace) -> Optional[str]:
    """A start-up notice when --quant-group-size defeats what the quantized backends are for: so small that each
    group's 4-byte fp32 scale makes an element cost as much as plain's, or wider than a weight row (one scale then
    spans rows of different ranges: the loss moves away from plain's; a group wider than a shard is cut there)."""
    codes = {"qwz": 1.0} if args.param_gather == "qwz" else {}
    if args.grad_reduce == "qgz":
        codes["qgz"] = args.qgz_bits / 8
    if not codes:
        return None
    g = args.quant_group_size
    plain = {"qwz": 2.0 if (args.bf16 or args.fp16) else 4.0, "qgz": 4.0}   # weights in model dtype, fp32 gradients
    costly = [f"{name} sends {c + 4 / g:.2f} bytes per element against plain's {plain[name]:.0f}"
              for name, c in codes.items() if c + 4 / g >= plain[name]]
    notes = []
    if costly:
        notes.append(f"--quant-group-size {g} is so small that each group's fp32 scale outweighs the savings "
                     f"({'; '.join(costly)})")
    if g > args.hidden_size:
        notes.append(f"--quant-group-size {g} is wider than a weight row (--hidden-size {args.hidden_size}): one "
                     "scale spans rows of different ranges, so the loss drifts from plain's (README, qgZ INT4); "
                     f"--quant-group-size {args.hidden_size} keeps a group inside a row")
    return "> " + "; ".join(notes) if notes else None


def _validate_backends(args: argparse.Namespace) -> None:
    check_backend_flags(args)
    args.qgz_bits = 4 if args.qgz_bits is None else args.qgz_bits
    args.quant_group_size = 2048 if args.quant_group_size is None else args.quant_group_size
    args.quant_notice = _quant_group_notice(args)
    if args.odo_progress_engine is None:   # the arguments table shows what runs (the default honours the env var)
        from megatron_ext.comm.progress import engine_enabled_by_default

        args.odo_progress_engine = engine_enabled_by_default()
    args.dp_ranks_per_node = dp_ranks_per_node(args)
    sharding_plan_from_args(args, args.data_parallel_size, args.dp_ranks_per_node)


def sharding_plan_from_args(args: argparse.Namespace, dp_size: int, dp_ranks_per_node: Optional[int]):
    """The ShardingPlan of the plan flags (checked against the DP group's size and nodes). Raises ArgumentError.

    ``--odo-accumulate`` and ``--num-distributed-optimizer-instances`` are spellings of the plan's factors; a
    contradiction between them and ``--grad-shard-size`` / ``--optim-shard-size`` names both flags.
    """
    from megatron_ext.optimizer.config import fold_accumulate
    from megatron_ext.optimizer.sharding import ShardingPlan

    param = getattr(args, "param_shard_size", None)
    grad = getattr(args, "grad_shard_size", None)
    optim = getattr(args, "optim_shard_size", None)
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    instances = 1 if instances is None else instances
    hpz = getattr(args, "hpz_partition_size", None)
    for flag, v in (("--param-shard-size", param), ("--grad-shard-size", grad), ("--optim-shard-size", optim),
                    ("--hpz-partition-size", hpz), ("--num-distributed-optimizer-instances", instances)):
        if v is not None and v < 1:   # 0 is not "all ranks": refused like any other non-positive size
            _fail(f"{flag} must be a positive integer, got {v}")
    try:
        if instances != 1:
            implied = ShardingPlan.from_instances(instances, dp_size)
            for flag, v in (("--optim-shard-size", optim), ("--grad-shard-size", grad)):
                if v is not None and v != implied.optim:
                    _fail(f"--num-distributed-optimizer-instances {instances} means {flag} {implied.optim} at DP "
                          f"size {dp_size}, but {flag} {v} was given: give one of the two")
            optim = grad = implied.optim
        if param is not None and param > 1:   # ZeRO-3: gradients and optimizer states follow the weights
            optim = param if optim is None else optim
            grad = optim if grad is None else grad
        plan = ShardingPlan(param=param or 1, grad="auto" if grad is None else grad, optim=optim, hpz=hpz or 1)
        plan = fold_accumulate(plan, getattr(args, "odo_accumulate", "auto") or "auto")
        plan.resolve(dp_size, dp_ranks_per_node or dp_size, 0)
    except ValueError as e:
        _fail(str(e))
    return plan


def check_backend_flags(args: argparse.Namespace) -> None:
    """The communication-backend flags on their own (shared with the Megatron-LM plug-in). Raises ArgumentError."""
    from megatron_ext.comm import available_grad_reduce, available_param_gather

    grad_reduce = getattr(args, "grad_reduce", "plain")
    param_gather = getattr(args, "param_gather", "plain")
    qgz_bits, group = getattr(args, "qgz_bits", None), getattr(args, "quant_group_size", None)
    if grad_reduce not in available_grad_reduce():
        _fail(f"--grad-reduce {grad_reduce} is not implemented in this build "
              f"(available: {', '.join(available_grad_reduce())})")
    if param_gather not in available_param_gather():
        _fail(f"--param-gather {param_gather} is not implemented in this build "
              f"(available: {', '.join(available_param_gather())})")
    if qgz_bits is not None and grad_reduce != "qgz":
        _fail(f"--qgz-bits is only meaningful with --grad-reduce qgz (got --grad-reduce {grad_reduce})")
    if getattr(args, "qgz_pipeline_stages", None) is not None and grad_reduce != "qgz":
        _fail(f"--qgz-pipeline-stages is only meaningful with --grad-reduce qgz (got --grad-reduce {grad_reduce})")
    if group is not None and grad_reduce != "qgz" and param_gather != "qwz":
        _fail("--quant-group-size is only meaningful with --grad-reduce qgz or --param-gather qwz")
    if group is not None and group <= 0:
        _fail(f"--quant-group-size must be positive, got {group}")
    rpn = getattr(args, "ranks_per_node", None)
    if rpn is not None and rpn <= 0:
        _fail(f"--ranks-per-node must be positive, got {rpn}")


# Flags of add_megatron_ext_args that only megatron_ext's own pretrain_gpt can honour: the Megatron-LM plug-in swaps
# the optimizer and DDP wrapper, but the checkout's pretrain_gpt.py builds its own GPTModel and optimizer state.
NOT_IN_MEGATRON_LM = {
    "hpz_partition_size": ("--hpz-partition-size", "parameter sharding (ZeRO-3/hpZ) through the plug-in has not "
                           "been run against a checkout yet; train with python -m megatron_ext.training.pretrain_gpt"),
    "param_shard_size": ("--param-shard-size", "see --hpz-partition-size"),
    "ladder_residual": ("--ladder-residual", "the checkout's model provider builds a standard GPTModel; train with "
                        "python -m megatron_ext.training.pretrain_gpt, or build "
                        "megatron_ext.transformer.ladder_gpt.LadderGPTModel in your own model provider"),
    "ladder_residual_layers": ("--ladder-residual-layers", "see --ladder-residual"),
    "desync_residual": ("--desync-residual", "see --ladder-residual"),
    "auto_plan": ("--auto-plan", "the checkout pads its vocabulary only after parsing, and the planner may choose "
                  "parameter sharding, which the plug-in does not run; print a plan with python -m "
                  "megatron_ext.planner (it takes Megatron's model flags) and pass the flags it prints"),
    "plan_profile": ("--plan-profile", "see --auto-plan"),
    "plan_hardware": ("--plan-hardware", "see --auto-plan"),
    "plan_gpu_memory": ("--plan-gpu-memory", "see --auto-plan"),
    "plan_allow_quantized": ("--plan-allow-quantized", "see --auto-plan"),
}


def check_megatron_lm_args(args: argparse.Namespace) -> None:
    """This project's flags as given to a Megatron-LM checkout (the plug-in). Raises ArgumentError naming the flag.

    Rejects what the plug-in cannot honour (``NOT_IN_MEGATRON_LM``), our flags given without
    ``--use-overlapped-distributed-optimizer`` (they would be ignored), and bad backend flag combinations.
    """
    for dest, (flag, reason) in NOT_IN_MEGATRON_LM.items():
        if getattr(args, dest, None) not in (None, False):
            _fail(f"{flag} is not supported by the Megatron-LM plug-in (megatron_ext.megatron_lm): {reason}")
    if not getattr(args, "use_overlapped_distributed_optimizer", False):
        for dest, flag, default in (("odo_accumulate", "--odo-accumulate", "auto"), ("grad_reduce", "--grad-reduce",
                                    "plain"), ("param_gather", "--param-gather", "plain"),
                                    ("qgz_bits", "--qgz-bits", None), ("quant_group_size", "--quant-group-size", None),
                                    ("qgz_pipeline_stages", "--qgz-pipeline-stages", None),
                                    ("ranks_per_node", "--ranks-per-node", None),
                                    ("param_shard_size", "--param-shard-size", None),
                                    ("grad_shard_size", "--grad-shard-size", None),
                                    ("optim_shard_size", "--optim-shard-size", None)):
            if getattr(args, dest, default) != default:
                _fail(f"{flag} needs --use-overlapped-distributed-optimizer (without it Megatron-LM's own optimizer "
                      "runs and the flag would be ignored)")
    check_backend_flags(args)


def dp_ranks_per_node(args: argparse.Namespace) -> Optional[int]:
    """DP ranks per node from ``--ranks-per-node`` (GPUs/processes per node, like torchrun's nproc-per-node).

    megatron-core orders ranks TP-fastest, then DP, then PP, so a node of R ranks holds R / TP consecutive members
    of each DP group (all of them when a node spans whole pipeline stages; fewer when a stage straddles two
    nodes, which is computed from the actual DP groups). None keeps the ODO's default (no LOCAL_WORLD_SIZE: one node).

    A layout no hierarchical split describes (a TP group or a pipeline stage across nodes, DP groups sitting unevenly)
    is an error naming ``--ranks-per-node`` when the user gave it. Derived from torchrun's ``LOCAL_WORLD_SIZE``, it
    is a layout Megatron-LM runs, so it runs here too: each DP group is then treated as one node (the ODO's
    documented fallback; hierarchical backends take their one-hop form), said in ``args.topology_notice``.
    """
    import os

    rpn = args.ranks_per_node
    if rpn is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            return None
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        try:
            return _dp_members_per_node(args, local, "LOCAL_WORLD_SIZE")
        except ArgumentError as e:
            args.topology_notice = (f"> the data-parallel groups do not split into nodes of LOCAL_WORLD_SIZE "
                                    f"({local}) ranks ({e}), a layout Megatron-LM runs: each is treated as one node "
                                    "(hierarchical backends take their one-hop form, and the log counts all of their "
                                    "bytes as intra-node); give --ranks-per-node to choose another split")
            return args.data_parallel_size
    return _dp_members_per_node(args, rpn, "--ranks-per-node")


def _dp_members_per_node(args: argparse.Namespace, rpn: int, flag: str) -> int:
    """Members of each DP group per node of ``rpn`` ranks; ArgumentError naming ``flag`` when no split fits."""
    tp, dp = args.tensor_model_parallel_size, args.data_parallel_size
    if rpn <= 0:
        _fail(f"{flag} must be positive, got {rpn}")
    if args.world_size % rpn != 0:
        _fail(f"{flag} ({rpn}) must divide the world size ({args.world_size})")
    if rpn % tp != 0:
        _fail(f"{flag} ({rpn}) must be a multiple of --tensor-model-parallel-size ({tp}): a TP group must not "
              "span nodes")
    from megatron_ext.comm import group_members_per_node as members_per_node

    counts = set()
    for stage in range(args.world_size // (tp * dp)):   # every DP group: same TP index and stage, TP apart
        for t in range(tp):
            group = [t + tp * d + tp * dp * stage for d in range(dp)]
            try:
                counts.add(members_per_node(group, rpn))
            except ValueError as e:
                _fail(f"{flag} ({rpn}): {e}")
    if len(counts) != 1:
        _fail(f"{flag} ({rpn}) puts {sorted(counts)} members of different data-parallel groups on a node: "
              "choose a pipeline size whose stages fill whole nodes")
    return counts.pop()


def _validate_later_features(args: argparse.Namespace) -> None:
    if args.ladder_residual or args.ladder_residual_layers is not None or args.desync_residual is not None:
        try:
            from megatron_ext.transformer.config import LadderConfig
        except ImportError:
            _fail("--ladder-residual/--ladder-residual-layers/--desync-residual: megatron_ext.transformer is not "
                  "available in this build")
        try:
            ladder = LadderConfig(ladder=args.ladder_residual, ladder_layers=args.ladder_residual_layers,
                                  desync=args.desync_residual)
            n_ladder = ladder.num_ladder_layers(args.num_layers)
        except ValueError as e:
            _fail(str(e))
        args.wiring_notice = _stage_wiring_notice(args, ladder, n_ladder)
        if args.tensor_model_parallel_size == 1:
            args.ladder_notice = (f"> {'--desync-residual' if ladder.desync else '--ladder-residual'} at "
                                  "--tensor-model-parallel-size 1: there is no tensor-parallel all-reduce to overlap "
                                  "or drop, so this trains the rewired network without its speed-up")
        if args.sequence_parallel:
            _fail("--ladder-residual/--desync-residual do not support --sequence-parallel (their reductions are "
                  "all-reduces of full-sequence partial sums)")


def _stage_wiring_notice(args: argparse.Namespace, ladder, n_ladder: int) -> Optional[str]:
    """A start-up notice when a pipeline-stage boundary changes the Ladder/Desync network: a stage ends by adding
    its pending outputs (ladder) or re-synchronising the residual (desync, after a module that keeps no all-reduce),
    so the trained function depends on the stage layout, unlike a standard model's."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if pp <= 1:
        return None
    layout = pipeline_layout(args, pp, 1)
    bounds = [layout.offset(stage) for stage in range(1, pp)]
    if ladder.desync:
        inside = [b for b in bounds if not ladder.reduces(2 * b - 1)]
        what = "re-synchronises the residual there (an all-reduce Desync drops at --pipeline-model-parallel-size 1)"
    else:
        inside = [b for b in bounds if b > layers - n_ladder]
        what = "adds the pending outputs there (at --pipeline-model-parallel-size 1 they are added one module later)"
    if not inside:
        return None
    return (f"> pipeline stages end after layer(s) {', '.join(map(str, inside))} inside the "
            f"{'Desync' if ladder.desync else 'Ladder'} layers: each stage {what}, so this network depends on "
            f"--pipeline-model-parallel-size {pp}; evaluate, fine-tune and serve it with the same stage layout")


def _training_length_unit(args: argparse.Namespace) -> str:
    """"iters" or "samples": Megatron-LM trains for --train-iters with the schedule in iterations, or for
    --train-samples with it in samples, never a mix (its validate_args asserts; here each conflict is named)."""
    if (args.train_iters is None) == (args.train_samples is None):
        _fail("give --train-iters or --train-samples" if args.train_iters is None else
              "--train-iters and --train-samples conflict: choose one")
    unit, other = ("iters", "samples") if args.train_iters is not None else ("samples", "iters")
    given = getattr(args, f"train_{unit}")
    if given <= 0:
        _fail(f"--train-{unit} must be positive, got {given}")
    for name in ("lr_decay", "lr_wsd_decay", "lr_warmup"):
        value = getattr(args, f"{name}_{other}")
        if value is not None and not (name == "lr_warmup" and value == 0):
            dash = name.replace("_", "-")
            _fail(f"--{dash}-{other} counts {other}, but this run is given --train-{unit}: use --{dash}-{unit}")
    return unit


def pipeline_layout(args: argparse.Namespace, pp: int, vp: Optional[int] = None) -> PipelineLayout:
    """Where this run's layers live (``vp`` model chunks per stage; default: the validated chunk count); bad
    pipeline-split flags fail here, by name."""
    try:
        return PipelineLayout.from_args(args, pp, vp)
    except ValueError as e:
        _fail(str(e))


def _validate_virtual_pipeline(args: argparse.Namespace, pp: int) -> None:
    """Megatron-LM's interleaved-pipeline flags, as its ``validate_args`` reads them: the model chunks per stage
    (``args.virtual_pipeline_model_parallel_size``, None without interleaving) and the stage counts they need."""
    per_chunk, chunks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    args.virtual_pipeline_model_parallel_size = None
    if per_chunk is None and chunks is None:
        if args.microbatch_group_size_per_vp_stage is not None:
            _fail("--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved pipeline only "
                  "(--num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage)")
        return
    if per_chunk is not None and chunks is not None:
        _fail("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank conflict: give one")
    flag = ("--num-layers-per-virtual-pipeline-stage" if per_chunk is not None
            else "--num-virtual-stages-per-pipeline-rank")
    value = per_chunk if per_chunk is not None else chunks
    if value <= 0:
        _fail(f"{flag} must be positive, got {value}")
    if pp <= 1 or (pp <= 2 and not args.overlap_p2p_comm):
        need = ("> 2 with --no-overlap-p2p-communication (a batch would hold two sends and two receives between the "
                "same two ranks)" if not args.overlap_p2p_comm else "> 1")
        _fail(f"{flag}: the interleaved pipeline needs --pipeline-model-parallel-size {need}, got {pp}")
    layout = pipeline_layout(args, pp, 1)
    if per_chunk is not None and not (layout.first is None and layout.last is None):
        _fail(f"{flag} does not fit uneven pipeline stages (--decoder-first/last-pipeline-num-layers): give the "
              "model chunks per stage with --num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
    slots = (args.num_layers + layout.account_for_embedding + layout.account_for_loss) // pp   # even splits only
    if layout.first is None and layout.last is None and slots % value:
        counted = (f" = --num-layers {args.num_layers} / --pipeline-model-parallel-size {pp}" if layout.even
                   else ", counting the embedding / loss as layers")
        _fail(f"{flag} ({value}) must divide the layers per pipeline stage ({slots}{counted})")
    if per_chunk is not None:
        chunks = slots // per_chunk
    if chunks == 1:   # one chunk per stage: the plain 1F1B schedule
        if args.microbatch_group_size_per_vp_stage is not None:
            _fail("--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved pipeline only "
                  f"({flag} {value} gives one chunk per stage)")
        return
    pipeline_layout(args, pp, chunks)
    args.virtual_pipeline_model_parallel_size = chunks
    for other, on in (("--ladder-residual/--desync-residual",
                       args.ladder_residual or args.ladder_residual_layers is not None or args.desync_residual),
                      ("--odo-speculative-step", args.odo_speculative_step),
                      # its activation model is the plain 1F1B schedule's (planner/model_spec.py)
                      ("--auto-plan", getattr(args, "auto_plan", False))):
        if on:
            _fail(f"{flag} does not work with {other} (it supports one model chunk per pipeline stage)")


def _check_interleaved_micro_batches(args: argparse.Namespace, pp: int, batch: Optional[int] = None) -> None:
    """megatron-core's interleaved schedule runs micro-batches in groups of
    ``--microbatch-group-size-per-virtual-pipeline-stage`` (default PP) per chunk; it raises inside the first step
    on counts it cannot schedule, so they are named here. ``batch``: a global batch size of the ramp-up (default
    --global-batch-size)."""
    per_step = args.micro_batch_size * args.data_parallel_size
    m = args.num_micro_batches if batch is None else batch // per_step
    source, fix = (("--global-batch-size", "--global-batch-size") if batch is None else
                   (f"the --rampup-batch-size global batch {batch}", "--rampup-batch-size"))
    split = f"{source} / (--micro-batch-size x data-parallel size)"
    at = "" if batch is None else f" (at {source})"
    given = args.microbatch_group_size_per_vp_stage is not None
    group = args.microbatch_group_size_per_vp_stage if given else pp
    if not given:
        if m < pp:
            _fail(f"the interleaved pipeline needs at least --pipeline-model-parallel-size ({pp}) micro-batches per "
                  f"step, got {m} (= {split}); raise {fix}")
    if not pp <= group <= m:
        _fail(f"--microbatch-group-size-per-virtual-pipeline-stage ({group}) must be between "
              f"--pipeline-model-parallel-size ({pp}) and the micro-batches per step ({m} = {split}); raise {fix}")
    if 0 < m % group < pp:
        if not given:   # (the group is PP: no remainder can be at least PP)
            _fail(f"the interleaved pipeline needs the micro-batches per step ({m}) to be a multiple of "
                  f"--pipeline-model-parallel-size ({pp}){at}; change {fix}")
        _fail(f"the interleaved pipeline needs the micro-batches per step ({m}) to be a multiple of "
              f"--microbatch-group-size-per-virtual-pipeline-stage ({group}), or to leave a remainder of at least "
              f"--pipeline-model-parallel-size ({pp}){at}; change {fix}")


def _validate_recompute(args: argparse.Namespace, pp: int) -> None:
    """Megatron-LM's recomputation flags, checked as megatron-core's TransformerConfig checks them but naming the
    flag: ``--recompute-activations`` is selective recomputation."""
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            _fail("--recompute-activations (selective) conflicts with --recompute-granularity "
                  f"{args.recompute_granularity}: choose one")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        # megatron-core recomputes within each model chunk's layers
        per_stage = pipeline_layout(args, pp).max_chunk_layers()
        if args.recompute_method is None:
            _fail("--recompute-granularity full needs --recompute-method uniform or block")
        if args.recompute_num_layers is None or not 1 <= args.recompute_num_layers <= per_stage:
            _fail(f"--recompute-granularity full needs --recompute-num-layers between 1 and the layers per pipeline "
                  f"stage{' chunk' if args.virtual_pipeline_model_parallel_size else ''} ({per_stage}), got "
                  f"{args.recompute_num_layers}")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        flag = "--recompute-method" if args.recompute_method is not None else "--recompute-num-layers"
        _fail(f"{flag} applies to --recompute-granularity full only (got "
              f"{args.recompute_granularity or 'no recomputation'})")


def _check_save_dir(path: str) -> None:
    """``--save`` must be a directory this process can create and write into, found before training starts rather
    than at the first save (every rank checks the same path: on a filesystem they share, alike)."""
    import os

    probe = os.path.abspath(path)
    while not os.path.exists(probe):   # the nearest existing ancestor is what a makedirs would write into
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        _fail(f"--save {path}: {probe} is not a directory")
    import shutil
    import tempfile

    try:   # a real write (os.access says yes to root on any writable-looking directory)
        shutil.rmtree(tempfile.mkdtemp(prefix=".megatron_ext_probe_", dir=probe))
    except OSError as e:
        _fail(f"--save {path}: cannot write into {probe} ({e.strerror or e})")


def _check_load_dir(args: argparse.Namespace) -> None:
    """A ``--load`` directory that does not exist fails here, before any process group (every rank checks the same
    path). The one exception is ``--load`` = ``--save``: nothing saved yet means starting from scratch, unless
    ``--exit-on-missing-checkpoint``. Whether what is there is a usable checkpoint is decided after the process group
    starts, where the ranks can agree on it."""
    if not os.path.isdir(args.load) and not (load_is_save(args) and not args.exit_on_missing_checkpoint):
        _fail(f"--load {args.load}: no such directory")


def load_is_save(args: argparse.Namespace) -> bool:
    """``--load`` and ``--save`` name the same directory (the launch scripts' resume-or-start pattern)."""
    return bool(args.load and args.save) and os.path.abspath(args.load) == os.path.abspath(args.save)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _env_world_size() -> int:
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
