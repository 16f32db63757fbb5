"""Does a checkpoint fit this run? Checks run on every rank before anything is loaded (see checkpointing.py).

Each check returns a list of problems (empty when the checkpoint fits), worded with the flag a user would change, so
that ``load_checkpoint`` can agree across ranks first and then fail everywhere with the same message.

* :func:`check_checkpoint_args`: the flags that fix the model's shape or numerics, like Megatron-LM's
  ``check_checkpoint_args`` (which compares layers, hidden size, heads, positions, padded vocabulary, tokenizer type
  and TP/PP sizes) plus the ones megatron_ext adds or Megatron-LM leaves to a later shape error (FFN size, KV
  channels, query groups, position embedding, normalization and its epsilon, rotary base and percent, SwiGLU, bias,
  tied embeddings, Ladder/Desynced Residual).
* :func:`check_scheduler_state`: Megatron-LM's ``--override-opt_param-scheduler`` /
  ``--use-checkpoint-opt_param-scheduler`` semantics (megatron-core's ``OptimizerParamScheduler._check_and_set``),
  with errors that name the flag instead of an assertion deep inside ``load_state_dict``.
* :func:`check_model_state` / :func:`check_optimizer_state`: what ``load_state_dict(strict=True)`` and the ODO's
  ``load_state_dict`` would reject, found without applying anything.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .pipeline_layout import layout_counts

# (name in the saved args, flag to name in the error). Compared on their effective values (see _effective).
MODEL_FLAGS: Tuple[Tuple[str, str], ...] = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("kv_channels", "--kv-channels"),
    ("num_query_groups", "--num-query-groups"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("position_embedding_type", "--position-embedding-type"),
    ("normalization", "--normalization"),
    ("swiglu", "--swiglu"),
    ("squared_relu", "--squared-relu"),
    ("qk_layernorm", "--qk-layernorm"),
    ("apply_layernorm_1p", "--apply-layernorm-1p"),
    ("norm_epsilon", "--norm-epsilon"),
    ("rotary_base", "--rotary-base"),
    ("rotary_percent", "--rotary-percent"),
    ("disable_bias_linear", "--disable-bias-linear"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("tokenizer_type", "--tokenizer-type"),
    ("tokenizer_vocab_size", "the tokenizer's vocabulary size (--tokenizer-model/--vocab-file/--vocab-size)"),
    ("padded_vocab_size", "the padded vocabulary size (--make-vocab-size-divisible-by)"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("virtual_pipeline_model_parallel_size",
     "the model chunks per pipeline stage (--num-virtual-stages-per-pipeline-rank or "
     "--num-layers-per-virtual-pipeline-stage)"),
    ("pipeline_layout", "the layers per pipeline stage (--decoder-first/last-pipeline-num-layers, "
                        "--account-for-embedding/loss-in-pipeline-split; tools/reshard_checkpoint.py moves them)"),
    ("ladder_residual", "--ladder-residual"),
    ("ladder_residual_layers", "--ladder-residual-layers"),
    ("desync_residual", "--desync-residual"),
)

# (scheduler attribute = state-dict key, flag, converts a value to what the user typed). Steps are samples.
SchedulerField = Tuple[str, str, Optional[Callable[[Any, Optional[int]], str]]]


def _steps(value: Any, gbs: Optional[int]) -> str:
    """A schedule length in samples, with the iterations it makes at that run's global batch size."""
    if gbs and isinstance(value, int) and value % gbs == 0:
        return f"{value} samples ({value // gbs} iterations of --global-batch-size {gbs})"
    return f"{value} samples"


SCHEDULER_FIELDS: Tuple[SchedulerField, ...] = (
    ("max_lr", "--lr", None),
    ("min_lr", "--min-lr", None),
    ("lr_warmup_steps", "--lr-warmup-iters / --lr-warmup-fraction", _steps),
    ("lr_decay_steps", "--lr-decay-iters (default --train-iters)", _steps),
    ("lr_decay_style", "--lr-decay-style", None),
    ("start_wd", "--start-weight-decay (constant style: --weight-decay)", None),
    ("end_wd", "--end-weight-decay (constant style: --weight-decay)", None),
    ("wd_incr_steps", "--train-iters (the weight-decay schedule length)", _steps),
    ("wd_incr_style", "--weight-decay-incr-style", None),
    ("wsd_decay_steps", "--lr-wsd-decay-iters (WSD)", _steps),
    ("lr_wsd_decay_style", "--lr-wsd-decay-style (WSD)", None),
)
# The scheduler settings megatron-core's state_dict leaves out (WSD's): saved beside it, so a resume compares them.
EXTRA_SCHEDULER_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")


def scheduler_state(scheduler) -> Dict[str, Any]:
    """What a checkpoint holds of the scheduler: megatron-core's state plus :data:`EXTRA_SCHEDULER_KEYS`."""
    return {**scheduler.state_dict(), **{k: getattr(scheduler, k, None) for k in EXTRA_SCHEDULER_KEYS}}


def load_scheduler_state(scheduler, saved: Dict[str, Any]) -> None:
    """megatron-core's ``load_state_dict``; with ``--use-checkpoint-opt_param-scheduler`` the checkpoint's WSD
    settings too (megatron-core keeps this run's, having none saved), and the learning rate recomputed."""
    scheduler.load_state_dict(saved)
    if getattr(scheduler, "use_checkpoint_opt_param_scheduler", False) and all(k in saved
                                                                                for k in EXTRA_SCHEDULER_KEYS):
        for k in EXTRA_SCHEDULER_KEYS:
            setattr(scheduler, k, saved[k])
        scheduler.step(increment=0)


# Flags that change how the layers are wired, not the parameters' names or shapes: a --finetune run may change them
# (seed 002 section 4.2: a pretrained standard model rewired as a Ladder hybrid and fine-tuned).
WIRING_FLAGS = ("ladder_residual", "ladder_residual_layers", "desync_residual")
# Flags that change the numerics, not the parameters: a --finetune run may change them too (a larger rotary base to
# extend the context is the usual case).
NUMERIC_FLAGS = ("norm_epsilon", "rotary_base", "rotary_percent")


def _effective(d: Dict[str, Any]) -> Dict[str, Any]:
    """Values as the model sees them: defaults that depend on other flags resolved, so ``--kv-channels 16`` equals
    leaving it out when 16 is hidden size / heads, and ``--ladder-residual`` equals ``--ladder-residual-layers``
    set to ``--num-layers`` (``--ladder-residual-layers 0``: a standard model)."""
    out = dict(d)
    if d.get("hidden_size") and d.get("num_attention_heads"):
        out["kv_channels"] = d.get("kv_channels") or d["hidden_size"] // d["num_attention_heads"]
        out["num_query_groups"] = (d.get("num_query_groups") if d.get("group_query_attention")
                                   else d["num_attention_heads"])
    if "virtual_pipeline_model_parallel_size" in d:   # None: one chunk per stage
        out["virtual_pipeline_model_parallel_size"] = d["virtual_pipeline_model_parallel_size"] or 1
    if d.get("num_layers") and d.get("pipeline_model_parallel_size"):   # (older checkpoints: the even split)
        out["pipeline_layout"] = layout_counts(d, d["pipeline_model_parallel_size"])
    if d.get("position_embedding_type", "rope") != "rope":   # rotary settings a model without rope never reads
        out["rotary_base"] = out["rotary_percent"] = None
    if "ladder_residual" in d:
        layers = d.get("ladder_residual_layers")
        n = (d.get("num_layers") if layers is None else layers) if d.get("ladder_residual") else 0
        out["ladder_residual"], out["ladder_residual_layers"] = bool(n), n
    return out


def check_checkpoint_args(saved: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    """Flags that fix the model's shape or numerics and differ between the saving run (``saved``) and this one; under
    ``--finetune`` the wiring and numeric flags (:data:`WIRING_FLAGS`, :data:`NUMERIC_FLAGS`) may differ.

    Names missing from ``saved`` (older checkpoints) are not compared.
    """
    old, new = _effective(saved), _effective(vars(args))
    problems = []
    for name, flag in MODEL_FLAGS:
        if getattr(args, "finetune", False) and name in WIRING_FLAGS + NUMERIC_FLAGS:
            continue
        if (name in saved or name == "pipeline_layout" and name in old) and old.get(name) != new.get(name):
            problems.append(f"{flag}: checkpoint {old.get(name)!r}, this run {new.get(name)!r}")
            div = saved.get("make_vocab_size_divisible_by")
            if name == "padded_vocab_size" and div and div != getattr(args, "make_vocab_size_divisible_by", div):
                problems[-1] += f" (the checkpoint's: --make-vocab-size-divisible-by {div})"
    return problems


def _in_samples(flag: str) -> str:
    """A schedule field's flag as a ``--train-samples`` run gives it (``--lr-decay-samples`` ...)."""
    return flag.replace("-iters", "-samples")


def check_scheduler_state(saved: Dict[str, Any], scheduler, saved_gbs: Optional[int] = None,
                          gbs: Optional[int] = None, samples: bool = False) -> List[str]:
    """Schedule values that differ, unless the scheduler was told which side wins (then megatron-core's
    ``load_state_dict`` takes this run's values or the checkpoint's, as in Megatron-LM). ``samples``: this run gives
    its lengths in samples (``--train-samples``), so the sample flags are named and the batch size is no cause."""
    if getattr(scheduler, "override_opt_param_scheduler", False) or getattr(
            scheduler, "use_checkpoint_opt_param_scheduler", False):
        return []
    problems: List[str] = []
    for key, flag, show in SCHEDULER_FIELDS:
        if key not in saved or not hasattr(scheduler, key):
            continue
        ours, theirs = getattr(scheduler, key), saved[key]
        if ours != theirs:
            fmt = show or (lambda v, _g: repr(v))
            if samples:
                flag = _in_samples(flag)
                fmt = (lambda v, _g: f"{v} samples") if show is _steps else fmt
            msg = f"{flag}: checkpoint {fmt(theirs, saved_gbs)}, this run {fmt(ours, gbs)}"
            if msg not in problems and not any(p.startswith(flag + ":") for p in problems):
                problems.append(msg)
            if (show is _steps and not samples and saved_gbs and gbs and saved_gbs != gbs
                    and not problems[0].startswith("--global")):
                problems.insert(0, f"--global-batch-size: checkpoint {saved_gbs}, this run {gbs} (schedule lengths "
                                   "are counted in samples)")
    return problems


def _extra_state(key: str) -> bool:
    return key == "_extra_state" or key.endswith("._extra_state")


def fit_extra_states(saved: Dict[str, Any], model: torch.nn.Module) -> Dict[str, Any]:
    """``saved`` with the modules' ``_extra_state`` entries as ``model`` has them: Transformer Engine's modules keep
    one (FP8 metadata) and megatron-core builds some of them (the final norm: ``TENorm``) whenever Transformer Engine
    is importable, whatever ``--transformer-impl`` says, so a checkpoint saved where it was (or was not) installed
    names extra states this model lacks (or misses some it has). A missing one keeps the module's own; one this model
    lacks is dropped -- as Megatron-LM, which retries such a load with ``strict=False``. Tensors stay strict."""
    expected = model.state_dict(keep_vars=True)
    out = {k: v for k, v in saved.items() if not _extra_state(k) or k in expected}
    out.update({k: v for k, v in expected.items() if _extra_state(k) and k not in saved})
    return out


def check_model_state(saved: Dict[str, Any], model: torch.nn.Module) -> List[str]:
    """What ``model.load_state_dict(saved, strict=True)`` would reject after :func:`fit_extra_states`:
    missing/unexpected names, other shapes."""
    expected = model.state_dict(keep_vars=True)
    problems = []
    missing = [k for k in expected if k not in saved and not _extra_state(k)]
    unexpected = [k for k in saved if k not in expected and not _extra_state(k)]
    if missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"not in this model: {_some(unexpected)}")
    if any("layer_norm_" in k for k in missing + unexpected) and any("layernorm." in k for k in missing + unexpected):
        problems.append("the layer norms are named for another --transformer-impl (Transformer Engine fuses them "
                        "into linear_qkv / linear_fc1 as layer_norm_weight); resume with the saving run's "
                        "--transformer-impl (tools/import_megatron_lm_checkpoint.py --transformer-impl local renames a "
                        "Megatron-LM checkpoint's)")
    for k, v in expected.items():   # (extra states are fitted, whatever their size: fit_extra_states)
        if _extra_state(k):
            continue
        w = saved.get(k)
        if torch.is_tensor(v) and torch.is_tensor(w) and tuple(v.shape) != tuple(w.shape):
            problems.append(f"{k}: checkpoint shape {tuple(w.shape)}, this model {tuple(v.shape)}")
    return problems


def check_optimizer_state(saved: Dict[str, Any], optimizer) -> List[str]:
    """What the ODO's ``load_state_dict`` would reject (``state_dict_problems``: another optimizer type, a parameter
    or state missing, a size that differs), for a checkpoint's canonical state, worded for pretrain_gpt's flags."""
    from megatron_ext.optimizer.checkpoint import CANONICAL_FORMAT
    from megatron_ext.optimizer.inner_optimizer import same_update_rule

    if not isinstance(saved, dict) or saved.get("format") != CANONICAL_FORMAT:
        fmt = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        return [f"not a canonical optimizer state (format {fmt!r})"]
    problems = optimizer.state_dict_problems(saved)
    inner = getattr(optimizer, "inner", None)
    if inner is not None and not same_update_rule(saved.get("optimizer"), inner):
        problems.append("resume with --no-load-optim to start a fresh optimizer from the saved weights")
    return problems


def _some(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
