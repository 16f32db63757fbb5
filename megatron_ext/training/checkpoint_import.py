"""Import a Megatron-LM checkpoint as a pretrain_gpt one (``tools/import_megatron_lm_checkpoint.py``).

The torch format is read here; torch_dist (Megatron-LM's default) in ``checkpoint_import_dist.py``, which shares the
args checks and ``common.pt`` below.

[Note: what is carried]
Megatron-LM's legacy format (``--ckpt-format torch``) holds, per TP/PP position, ``mp_rank_TT[_PPP]/
model_optim_rng.pt``: the megatron-core module's state dict (``model``, or ``model0``, ``model1``, ... per model
chunk), the run's ``args``, ``iteration``, the LR scheduler and RNG states, and the optimizer's state in the layout of
whichever Megatron optimizer saved it. pretrain_gpt builds the same megatron-core ``GPTModel``, so the weights carry
over unchanged, position by position, into ``mp_rank_TT_PPP/model.pt``. ``common.pt`` gets the iteration, the
consumed train/valid samples (the data position: the same ``--data-path``, split and ``--seed`` continue where
Megatron-LM stopped), the scheduler's state and the model-shaping flags from ``args`` (for the resume's checks).

The optimizer state is carried when the megatron_ext plug-in saved it (``--use-overlapped-distributed-optimizer``):
its ``distrib_optim.pt`` is the ODO's canonical per-parameter state, the layout of pretrain_gpt's ``optim.pt`` (the
same writer, ``write_canonical_optimizer_state``), and the parameter names agree because both wrap the same modules
(``Float16Module`` for bf16/fp16, one wrapper per model chunk); the resume then continues exactly, LR schedule
included. So does Megatron's own ``DistributedOptimizer``'s: its ``distrib_optim.pt`` holds each gradient buffer's
buckets back to back, placed parameter by parameter and proved against the weights (``checkpoint_import_optim.py``);
and its non-distributed optimizers' (``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``: torch Adam's state
inside ``model_optim_rng.pt`` by param-group order, placed by megatron-core's grouping rule and proved the same way).
Chained optimizers and older bucket layouts are not carried: the checkpoint is marked as saved without one and a
resume passes ``--no-load-optim`` (fresh Adam moments from the loaded weights; as with Megatron-LM's own
flag, the LR schedule is not loaded either and starts again from its warm-up, which suits fresh moments) or
``--finetune``. RNG states are never carried (re-seeded from ``--seed``, as after a reshard). Expert-parallel (MoE)
checkpoints and the legacy (non-megatron-core) GPT model are refused.

Layer names: Transformer Engine's layers (``--transformer-impl transformer_engine``, Megatron-LM's default) fuse the
layer norms into the following linear layer (``self_attention.linear_qkv.layer_norm_weight``) and keep an
``_extra_state`` (FP8 metadata) per module; megatron-core's local layers name the norms ``input_layernorm`` and
``pre_mlp_layernorm``, and only their linear layers have an extra state, always None and ignored on load.
``transformer_impl="local"`` renames by megatron-core's own map (the local layer spec's
``sharded_state_dict_keys_map``), sets the linear layers' extra states to None and drops the others (the fused
attention's); the other way round (local names for a Transformer Engine run) is refused, since Transformer Engine's
extra state cannot be made up here.

The written checkpoint has Megatron-LM's TP/PP sizes and pipeline split; ``tools/reshard_checkpoint.py`` rewrites it
for others. The source is only read; the result is published atomically with its manifest (checkpointing.py).
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .checkpointing import (FORMAT, TRACKER, CheckpointError, check_offline_target, iter_dir_name,
                            megatron_lm_format, mp_dir_name, offline_checkpoint)
from ..megatron_lm.optimizer_state import COMMON_FORMAT
from ..optimizer.checkpoint import CANONICAL_FORMAT
from .checkpoint_import_optim import torch_format_state
from .pipeline_layout import LAYOUT_ARGS

_MP_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_MODEL_CHUNK = re.compile(r"model(\d+)")
_EXTRA_STATE = re.compile(r"(^|\.)_extra_state$")
# megatron-core's local linear layers keep an (ignored, None) ``_extra_state`` for Transformer Engine's state dicts
_LOCAL_EXTRA_STATE = re.compile(r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer)\._extra_state$")
_IMPLS = ("local", "transformer_engine")


class _Unknown:
    """Stands in for a class the saving Megatron-LM pickled and this environment cannot import (an ``args`` value of
    another version's enum, say); such values are left out of the imported flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _Unknown


class _lenient_pickle:   # a ``pickle_module`` for torch.load
    Unpickler = _LenientUnpickler
    load = pickle.load


def _read(path: str) -> Dict[str, Any]:
    """A Megatron-LM file, its tensors memory-mapped (a position's weights and fp32 optimizer state can be tens of
    GB: they are paged through on their way to the new file, never all held)."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_lenient_pickle)
        except RuntimeError as e:   # a file in torch's legacy (non-zip) serialization cannot be mapped
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_lenient_pickle)
    except Exception as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a Megatron-LM checkpoint file (a {type(state).__name__})")
    return state


def megatron_lm_checkpoint_dir(load_dir: str, iteration: Optional[int] = None) -> str:
    """The iteration directory Megatron-LM would load: ``iteration`` (its ``--ckpt-step``), else the tracker's
    (``release`` included). Refuses pretrain_gpt's own."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if iteration is None:
        tracker = os.path.join(load_dir, TRACKER)
        if not os.path.isfile(tracker):
            raise CheckpointError(f"--load {load_dir}: no {TRACKER} (Megatron-LM's tracker); pass --ckpt-step to "
                                  "name the iteration")
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            ckpt = os.path.join(load_dir, "release")
        else:
            try:
                ckpt = os.path.join(load_dir, iter_dir_name(int(text)))
            except ValueError:
                raise CheckpointError(f"--load {load_dir}: corrupt tracker {tracker} ({text[:40]!r})") from None
    else:
        ckpt = os.path.join(load_dir, iter_dir_name(iteration))
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"--load {load_dir}: {ckpt} does not exist")
    names = os.listdir(ckpt)
    if "manifest.json" in names and "common.pt" in names:
        raise CheckpointError(f"{ckpt} is a pretrain_gpt checkpoint already: load it directly "
                              "(tools/reshard_checkpoint.py changes its TP/PP sizes)")
    return ckpt


def _positions(ckpt: str) -> Dict[Tuple[int, int], str]:
    """``(tp_rank, pp_rank) -> model_optim_rng.pt`` of every position saved in ``ckpt``."""
    out: Dict[Tuple[int, int], str] = {}
    for name in sorted(os.listdir(ckpt)):
        m = _MP_DIR.fullmatch(name)
        path = os.path.join(ckpt, name, "model_optim_rng.pt")
        if m is None or not os.path.isfile(path):
            continue
        if m.group(3) is not None:
            raise CheckpointError(f"{ckpt}: {name} is an expert-parallel (MoE) position; pretrain_gpt trains dense "
                                  "GPT models only")
        out[int(m.group(1)), int(m.group(2) or 0)] = path
    if not out:
        raise CheckpointError(f"{ckpt}: no mp_rank_*/model_optim_rng.pt (not a Megatron-LM --ckpt-format torch "
                              "checkpoint)")
    return out


# Megatron-LM's args that pretrain_gpt keeps under another name (its flag's destination there).
_RENAMED_ARGS = {"layernorm_zero_centered_gamma": "apply_layernorm_1p",   # --apply-layernorm-1p
                 "layernorm_epsilon": "norm_epsilon"}                      # --norm-epsilon

# Model settings pretrain_gpt does not build: (saved arg, Megatron-LM's flag); refused unless unset/False/0.
_UNSUPPORTED_MODEL_ARGS = (
    ("num_experts", "--num-experts (mixture of experts)"),
    ("multi_latent_attention", "--multi-latent-attention"),
    ("mtp_num_layers", "--mtp-num-layers (multi-token prediction)"),
    ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout (resave with the layer-count flags)"),
    ("rotary_interleaved", "--rotary-interleaved"),
    ("use_rope_scaling", "--use-rope-scaling"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor"),
    ("window_size", "--window-size (sliding-window attention)"),
    ("no_rope_freq", "--no-rope-freq"),
)


def imported_args(ns: Any) -> Dict[str, Any]:
    """Megatron-LM's saved ``args`` as pretrain_gpt saves its own: plain values only (what the resume compares), and
    the flags whose destination differs (``--disable-bias-linear`` is Megatron-LM's ``add_bias_linear=False``;
    :data:`_RENAMED_ARGS`)."""
    src = vars(ns) if isinstance(ns, argparse.Namespace) else dict(getattr(ns, "__dict__", {}) or {})
    plain = (int, float, str, bool, type(None))
    out = {k: v for k, v in src.items()
           if isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))}
    if "add_bias_linear" in out:
        out["disable_bias_linear"] = not out.pop("add_bias_linear")
    for theirs, ours in _RENAMED_ARGS.items():
        if theirs in out and ours not in out:
            out[ours] = out.pop(theirs)
    return out


def model_problems(args: Dict[str, Any], src: Any) -> List[str]:
    """What pretrain_gpt cannot build of the saved model, by Megatron-LM's flag (``src``: the raw saved args)."""
    raw = vars(src) if isinstance(src, argparse.Namespace) else dict(getattr(src, "__dict__", {}) or {})
    problems = [f"{flag} = {raw[name]!r}" for name, flag in _UNSUPPORTED_MODEL_ARGS
                if raw.get(name) not in (None, False, 0, "")]
    if (args.get("expert_model_parallel_size") or 1) > 1:
        problems.append(f"--expert-model-parallel-size = {args['expert_model_parallel_size']}")
    if raw.get("add_qkv_bias") and args.get("disable_bias_linear"):
        problems.append("--add-qkv-bias with --disable-bias-linear")
    if args.get("transformer_impl") not in (None, *_IMPLS):
        problems.append(f"--transformer-impl {args['transformer_impl']}")
    return problems


def checked_args(saved: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The saved ``args`` as pretrain_gpt keeps them (:func:`imported_args`), refused by flag when pretrain_gpt
    cannot build the model."""
    if "args" not in saved:
        raise CheckpointError(f"{where}: no 'args' entry (not written by Megatron-LM's save_checkpoint)")
    args = imported_args(saved["args"])
    problems = model_problems(args, saved["args"])
    if problems:
        raise CheckpointError(f"{where}: a model pretrain_gpt does not build (dense megatron-core GPT): "
                              + "; ".join(problems))
    return args


def imported_common(saved: Dict[str, Any], args: Dict[str, Any], step: int, has_optim: bool, ckpt: str,
                    transformer_impl: str) -> Dict[str, Any]:
    """pretrain_gpt's ``common.pt`` for Megatron-LM's checkpoint ``ckpt`` (``saved``: its entries beside the
    model): the iteration, data position, LR schedule and model flags; no DP size (any resumes)."""
    args = dict(args, transformer_impl=transformer_impl, world_size=None, data_parallel_size=None)
    if (args.get("virtual_pipeline_model_parallel_size") or 1) == 1:
        args["virtual_pipeline_model_parallel_size"] = None
    for k in LAYOUT_ARGS:
        args.setdefault(k, None if "num_layers" in k else False)
    scheduler = saved.get("opt_param_scheduler") or saved.get("lr_scheduler")
    return {"format": FORMAT, "iteration": step,
            "consumed_train_samples": int(args.get("consumed_train_samples") or 0),
            "consumed_valid_samples": int(args.get("consumed_valid_samples") or 0),
            "scheduler": dict(scheduler) if isinstance(scheduler, dict) else None,
            "world_size": None, "tensor_model_parallel_size": args.get("tensor_model_parallel_size") or 1,
            "pipeline_model_parallel_size": args.get("pipeline_model_parallel_size") or 1,
            "data_parallel_size": None, "has_optim": has_optim, "args": args,
            "imported_from": os.path.realpath(ckpt)}


def te_to_local_names() -> List[Tuple[str, str]]:
    """(Transformer Engine prefix, local prefix) inside a layer, from megatron-core's local layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    return [(te, local) for local, te in keys_map.items()]


def _local_to_te_name(key: str) -> str:
    """A local layer's name as Transformer Engine's layers (and torch_dist) name it."""
    for te, local in te_to_local_names():
        key = key.replace("." + local, "." + te)
    return key


def rename_for_local(state: Dict[str, Any], renames: List[Tuple[str, str]]) -> Dict[str, Any]:
    """A Transformer Engine model's state dict with the local layers' names (see the module note)."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if _EXTRA_STATE.search(key):
            if _LOCAL_EXTRA_STATE.search(key):
                out[key] = None
            continue
        for te, local in renames:
            i = key.find("." + te)
            if i >= 0:
                key = key[:i + 1] + local + key[i + 1 + len(te):]
                break
        out[key] = value
    return out


def _plugin_optimizer_state(saved: Dict[str, Any], path: str, renames: Optional[List[Tuple[str, str]]]
                            ) -> Optional[Dict[str, Any]]:
    """The canonical optimizer state the megatron_ext plug-in saved beside ``path`` (None for Megatron's own
    optimizers), its parameter names as the model's after ``renames``."""
    common = saved.get("optimizer")
    if not (isinstance(common, dict) and common.get("format") == COMMON_FORMAT):
        return None
    odo = os.path.join(os.path.dirname(path), "distrib_optim.pt")
    if not os.path.isfile(odo):
        raise CheckpointError(f"{path} was saved by the megatron_ext plug-in, but its parameter state {odo} is "
                              "missing (an incomplete save?)")
    state = _read(odo)
    if state.get("format") != CANONICAL_FORMAT or state.get("optimizer") != common.get("optimizer"):
        raise CheckpointError(f"{odo}: not the plug-in's canonical {common.get('optimizer')} state "
                              f"(format {state.get('format')!r}, optimizer {state.get('optimizer')!r})")
    if renames is not None:
        state["params"] = rename_for_local(state["params"], renames)
    return state


def _model_chunks(saved: Dict[str, Any], path: str, vp: int) -> List[Dict[str, Any]]:
    if vp == 1:
        if "model" not in saved:
            raise CheckpointError(f"{path}: no 'model' entry")
        return [saved["model"]]
    chunks = sorted((int(m.group(1)), v) for k, v in saved.items() if (m := _MODEL_CHUNK.fullmatch(k)))
    if [i for i, _ in chunks] != list(range(vp)):
        raise CheckpointError(f"{path}: expected model0..model{vp - 1} for {vp} model chunks per stage "
                              f"(--num-layers-per-virtual-pipeline-stage), found {[f'model{i}' for i, _ in chunks]}")
    return [v for _, v in chunks]


def import_megatron_lm_checkpoint(load_dir: str, save_dir: str, transformer_impl: Optional[str] = None,
                                  iteration: Optional[int] = None, log: Callable[[str], None] = print,
                                  load_optim: bool = True) -> str:
    """Write Megatron-LM's checkpoint in ``load_dir`` (the tracker's, or ``iteration``) into ``save_dir`` as a
    pretrain_gpt checkpoint at the same TP/PP sizes; returns the new checkpoint directory. ``transformer_impl``: the
    layer names the resuming run's ``--transformer-impl`` needs (default: the saving run's). ``load_optim=False``:
    the weights alone, whatever optimizer state there is."""
    if transformer_impl is not None and transformer_impl not in _IMPLS:
        raise CheckpointError(f"--transformer-impl {transformer_impl}: choose one of {', '.join(_IMPLS)}")
    ckpt = megatron_lm_checkpoint_dir(load_dir, iteration)
    check_offline_target(load_dir, save_dir, "imported")
    if megatron_lm_format(ckpt) == "torch_dist":
        from .checkpoint_import_dist import import_torch_dist

        return import_torch_dist(ckpt, save_dir, transformer_impl, log, load_optim)
    files = _positions(ckpt)
    first = _read(files[min(files)])
    args = checked_args(first, files[min(files)])
    tp, pp = args.get("tensor_model_parallel_size") or 1, args.get("pipeline_model_parallel_size") or 1
    vp = args.get("virtual_pipeline_model_parallel_size") or 1
    missing = [mp_dir_name(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing or len(files) != tp * pp:
        raise CheckpointError(f"{ckpt}: saved at TP {tp} x PP {pp} (its args), but the positions found are "
                              f"{sorted(files)}; missing: {missing or 'none'}")
    source_impl = args.get("transformer_impl") or "transformer_engine"
    target_impl = transformer_impl or source_impl
    if (source_impl, target_impl) == ("local", "transformer_engine"):
        raise CheckpointError("--transformer-impl transformer_engine: the checkpoint was saved with local layers, "
                              "whose weights lack Transformer Engine's extra state; resume with --transformer-impl "
                              "local")
    renames = te_to_local_names() if (source_impl, target_impl) == ("transformer_engine", "local") else None
    step = 0 if os.path.basename(ckpt) == "release" else int(first.get("iteration", 0))

    final = os.path.join(save_dir, iter_dir_name(step))
    carried: List[Optional[str]] = []   # per position: whose optimizer state was carried
    why_not = ""
    # the layer table's (Transformer Engine's) names of a local run's layer norms; the canonical names' prefix
    te_names = (lambda key: key) if source_impl != "local" else _local_to_te_name
    prefix = "module." if args.get("bf16") or args.get("fp16") else ""
    with offline_checkpoint(save_dir, step) as save:
        for (t, p), path in sorted(files.items()):
            saved = first if (t, p) == min(files) else _read(path)
            if int(saved.get("iteration", step)) != int(first.get("iteration", step)):
                raise CheckpointError(f"{path}: iteration {saved.get('iteration')}, not {first.get('iteration')} "
                                      "as the other positions (a mix of two saves)")
            chunks = _model_chunks(saved, path, vp)
            if any(k.startswith("language_model.") for c in chunks for k in c):
                raise CheckpointError(f"{path}: a legacy (non-megatron-core) GPT model (language_model.*); "
                                      "pretrain_gpt builds megatron-core's GPTModel (--use-mcore-models)")
            unreadable = [k for c in chunks for k, v in c.items() if isinstance(v, _Unknown)]
            if unreadable:   # e.g. FP8 parameters of a Transformer Engine this environment lacks
                raise CheckpointError(f"{path}: model entries of a type this environment cannot import: "
                                      f"{', '.join(unreadable[:4])}")
            optim = _plugin_optimizer_state(saved, path, renames) if load_optim else None
            kind = "the megatron_ext plug-in's"
            if not load_optim:
                why_not = "not read: --no-load-optim"
            elif optim is None:   # Megatron's own optimizers', placed against the weights as saved
                optim, text = torch_format_state(saved, path, chunks, te_names, source_impl != "local", prefix, args)
                kind, why_not = (text, why_not) if optim is not None else (kind, text)
                if optim is not None and renames is not None:
                    optim["params"] = rename_for_local(optim["params"], renames)
            if renames is not None:
                chunks = [rename_for_local(c, renames) for c in chunks]
            model = chunks[0] if vp == 1 else {f"model{i}": c for i, c in enumerate(chunks)}
            save(model, os.path.join(mp_dir_name(t, p), "model.pt"))
            carried.append(kind if optim is not None else None)
            if optim is not None:
                save(optim, os.path.join(mp_dir_name(t, p), "optim.pt"))
            del saved, chunks, model, optim
        if len(set(carried)) > 1:
            kinds = sorted(str(k) for k in set(carried))
            raise CheckpointError(f"{ckpt}: the positions' optimizer states differ in kind ({kinds}): a mix of two "
                                  "saves?")
        save(imported_common(first, args, step, carried[0] is not None, ckpt, target_impl), "common.pt")
    names = f"; layer names {source_impl} -> {target_impl}" if renames is not None else ""
    carried_text = (f"{carried[0]} optimizer state and the LR schedule; no RNG state" if carried[0] else
                    f"no optimizer state ({why_not}) or RNG state: resume with --no-load-optim, or --finetune")
    log(f"> imported Megatron-LM's {ckpt} (iteration {step}, TP {tp}, PP {pp}, {vp} chunk(s) per stage{names}) into "
        f"{final}: weights, iteration, data position; {carried_text}")
    return final
