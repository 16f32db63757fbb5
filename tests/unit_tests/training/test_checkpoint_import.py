"""tools/import_megatron_lm_checkpoint.py: a Megatron-LM (--ckpt-format torch) checkpoint continues in pretrain_gpt.

The Megatron-LM checkpoints here are written as Megatron-LM's ``save_checkpoint`` lays them out (``generate_state_dict``
of its ``training/checkpointing.py``): ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`` with ``args`` (an
``argparse.Namespace``), ``iteration``, ``model`` / ``model<i>``, ``optimizer``, ``opt_param_scheduler`` and
``rng_state``, and Transformer Engine's layer names (its default ``--transformer-impl``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys

import pytest
import torch

from megatron_ext.training.checkpoint_import import import_megatron_lm_checkpoint, rename_for_local, te_to_local_names
from megatron_ext.training.checkpoint_import_optim import NON_DISTRIBUTED
from megatron_ext.training.checkpointing import TRACKER, CheckpointError, verify_checksums

from .conftest import REPO
from .test_checkpoint_resume import _load_error
from .test_pretrain_gpt import _data_flags

# local name -> Transformer Engine's (megatron-core's local layer spec maps them the other way for dist-checkpoints)
TE_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
TE_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention",
                  "mlp.linear_fc1", "mlp.linear_fc2")


def _tool(argv):
    spec = importlib.util.spec_from_file_location("import_megatron_lm_checkpoint",
                                                  os.path.join(REPO, "tools", "import_megatron_lm_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.main(argv)


def _te_name(key):
    for local, te in TE_NAMES.items():
        key = key.replace("." + local, "." + te)
    return key


def _as_transformer_engine(state):
    """A local-spec state dict as Transformer Engine's layers name it, each TE module with its extra state."""
    out = {_te_name(key): value for key, value in state.items()}
    layers = sorted({k.split(".self_attention.")[0] for k in out if ".self_attention." in k})
    for layer in layers:
        for module in TE_EXTRA_STATE:
            out[f"{layer}.{module}._extra_state"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    return out


def _megatron_lm_args(ours: str):
    """(iteration, its directory, common.pt, args as Megatron-LM names them) of pretrain_gpt's checkpoint ``ours``."""
    iteration = int(open(os.path.join(ours, TRACKER)).read())
    src = os.path.join(ours, f"iter_{iteration:07d}")
    common = torch.load(os.path.join(src, "common.pt"), weights_only=False)
    saved = dict(common["args"])
    # the destinations of Megatron-LM's --disable-bias-linear, --apply-layernorm-1p and --norm-epsilon
    saved["add_bias_linear"] = not saved.pop("disable_bias_linear")
    saved["layernorm_zero_centered_gamma"] = saved.pop("apply_layernorm_1p")
    saved["layernorm_epsilon"] = saved.pop("norm_epsilon")
    saved.update(consumed_train_samples=common["consumed_train_samples"],
                 consumed_valid_samples=common["consumed_valid_samples"], use_distributed_optimizer=True)
    return iteration, src, common, saved


@contextlib.contextmanager
def _megatron_core_on_cpu():
    """megatron-core's DDP, DistributedOptimizer and dist-checkpoint save, which assume CUDA, run on CPU tensors
    (test only: they write the Megatron-LM checkpoints the import reads; the import itself needs none of this).
    Allocations asked of CUDA land on the CPU, ``.cuda()`` is the identity, a CPU tensor's ``type()`` reads as
    CUDA's (the optimizer checks it), ``torch.cuda.synchronize`` / ``current_device`` are host no-ops, and the
    checkpoint writer may start its worker processes from the harness's (daemonic) ranks. The writer's results queue
    is served by a forked manager process rather than megatron-core's spawned one (which re-imports torch: 3.4 s of
    every rank's first save, on a CPU where nothing forbids forking)."""
    import multiprocessing
    from unittest import mock

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.overrides import TorchFunctionMode

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and "cuda" in str(args[1]):
                args = (args[0], "cpu", *args[2:])
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return func(*args).replace("torch.", "torch.cuda.", 1)
            return func(*args, **kwargs)

    with CudaOnCpu(), mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None), \
            mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
            mock.patch.dict(multiprocessing.current_process()._config, {"daemon": False}):
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        yield


def _megatron_distributed_optimizer(modules, canonical: dict, argv):
    """megatron-core's own DDP (one per model chunk) + DistributedOptimizer around ``modules`` (under
    :func:`_megatron_core_on_cpu`), holding the canonical optimizer state ``canonical`` (pretrain_gpt's ``optim.pt``
    of this position): each DP rank's main-parameter shard, Adam moments and step, copied through the optimizer's
    own parameter ranges."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.training.arguments import parse_args

    config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                           overlap_grad_reduce=True, bucket_size=20000)
    ddps = [DistributedDataParallel(m.config, config, m) for m in modules]
    args = parse_args(argv)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, use_distributed_optimizer=True),
        ddps)
    _fill_megatron_optimizer(optimizer, modules, canonical)
    return optimizer


def _fill_megatron_optimizer(optimizer, modules, canonical: dict) -> None:
    """megatron-core's own optimizer (one, chained) over ``modules`` set to the canonical state ``canonical``
    (pretrain_gpt's ``optim.pt`` of this position; entries named as the optimizer sees the parameters: Float16Module's,
    by chunk): Adam's step, lr and weight decay, each main weight and moment. The DistributedOptimizer's through its
    own parameter ranges (this DP rank's shard); the non-distributed one's main weights (fp32 copies of bf16/fp16
    weights; an fp32 weight is its own)."""
    (inner,) = optimizer.chained_optimizers
    _adam_at(inner.optimizer, canonical)
    distributed = hasattr(inner, "model_param_group_index_map")
    main_of = {id(p): main for model, mains in zip(getattr(inner, "float16_groups", []),
                                                   getattr(inner, "fp32_from_float16_groups", []))
               for p, main in zip(model, mains)}
    with torch.no_grad():
        for chunk, module in enumerate(modules):
            for name, p in module.named_parameters():
                entry = canonical["params"][name if len(modules) == 1 else f"{chunk}.{name}"]
                if distributed:
                    if p not in inner.model_param_group_index_map:   # no element of it in this DP rank's shard
                        continue
                    piece = inner._get_model_param_range_map(p)["param"]
                    tensors = inner._get_main_param_and_optimizer_states(p)
                    for ours, theirs in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                        tensors[theirs].copy_(entry[ours][piece.start:piece.end])
                    continue
                main = main_of.get(id(p), p)
                main.copy_(entry["master"].view_as(main))
                for field in ("exp_avg", "exp_avg_sq"):
                    inner.optimizer.state[main][field].copy_(entry[field].view_as(main))


def _adam_at(adam, canonical: dict) -> None:
    """torch's Adam ``adam`` at the canonical state's step, learning rate and weight decay, with the state it builds
    at its first step (the moments zero, to be filled)."""
    current = {g["wd_mult"]: g for g in canonical["param_groups"]}   # the schedule's lr and weight decay now
    for group in adam.param_groups:
        group.update(lr=current[group["wd_mult"]]["lr"], weight_decay=current[group["wd_mult"]]["weight_decay"])
        for p in group["params"]:
            adam.state[p].update(step=torch.tensor(float(canonical["step"])), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))


def _plugin_optimizer(modules, canonical: dict, argv):
    """The megatron_ext plug-in's ODO around ``modules`` (this rank's DP group), holding the canonical state
    ``canonical``."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx
    from megatron_ext.megatron_lm.optimizer_state import MegatronLMOverlappedOptimizer
    from megatron_ext.training.arguments import parse_args

    args = parse_args(argv)
    ddps = [mx.OverlappedDDP(m, mx.OverlapConfig(bucket_size=3000), ps.get_data_parallel_group()) for m in modules]
    optimizer = MegatronLMOverlappedOptimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        use_distributed_optimizer=True), ddps)
    optimizer.load_state_dict(canonical)
    return optimizer


def _megatron_non_distributed_optimizer(modules, canonical: dict, argv):
    """megatron-core's own DDP + its non-distributed optimizer (Megatron-LM's default without
    ``--use-distributed-optimizer``: fp32 main weights beside bf16/fp16 ones, Adam on those; on fp32 weights, Adam on
    the weights) around ``modules``, holding the canonical state ``canonical`` (under :func:`_megatron_core_on_cpu`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.training.arguments import parse_args

    config = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
    ddps = [DistributedDataParallel(m.config, config, m) for m in modules]
    args = parse_args(argv)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        use_distributed_optimizer=False), ddps)
    _fill_megatron_optimizer(optimizer, modules, canonical)
    return optimizer


def _write_torch_dist(argv, ours: str, saves: dict) -> None:
    """pretrain_gpt's checkpoint ``ours`` saved as Megatron-LM saves ``--ckpt-format torch_dist`` (every rank):
    the same megatron-core model chunks built at the run's TP/PP and loaded from ``ours``; their
    ``sharded_state_dict`` with the entries of Megatron-LM's ``generate_state_dict``, by megatron-core's
    ``dist_checkpointing.save`` (under :func:`_megatron_core_on_cpu`). ``saves``: checkpoint directory -> None, or
    also Megatron's DistributedOptimizer's state in that ``distrib_optim_sharding_type`` (Megatron-LM's default:
    ``dp_reshardable``), or ``NON_DISTRIBUTED``: its non-distributed optimizer's (Megatron-LM's default optimizer), or
    ``"odo"``: the megatron_ext plug-in's (its ODO wraps the model chunks: alone in a call)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.checkpoint_compat import fit_extra_states
    from megatron_ext.training.checkpointing import chunk_states
    from megatron_ext.training.initialize import init_model_parallel
    from megatron_ext.training.model import build_model_chunks

    iteration, src, common, saved = _megatron_lm_args(ours)
    args = parse_args(argv)
    init_model_parallel(args)
    try:
        args.padded_vocab_size = common["args"]["padded_vocab_size"]
        modules = build_model_chunks(args)   # (Float16Module-wrapped for --bf16, as in Megatron-LM)
        position = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_{ps.get_pipeline_model_parallel_rank():03d}"
        states = chunk_states(torch.load(os.path.join(src, position, "model.pt"), weights_only=False), len(modules))
        for module, state in zip(modules, states):
            gpt = getattr(module, "module", module)
            gpt.load_state_dict(fit_extra_states(state, gpt), strict=True)
        saved.update(ckpt_format="torch_dist")
        metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if dist.get_rank() == 0:
            for mlm in saves:
                os.makedirs(os.path.join(mlm, f"iter_{iteration:07d}"))
        dist.barrier()
        optimizers = {}
        canonical = torch.load(os.path.join(src, position, "optim.pt"), weights_only=False)
        with _megatron_core_on_cpu():
            for mlm, sharding in saves.items():
                state_dict = {"args": argparse.Namespace(**saved), "checkpoint_version": 3.0, "iteration": iteration,
                              "opt_param_scheduler": common["scheduler"], "num_floating_point_operations_so_far": 0}
                for i, module in enumerate(modules):
                    state_dict["model" if len(modules) == 1 else f"model{i}"] = module.sharded_state_dict(
                        metadata=metadata)
                if sharding == "odo":   # the plug-in's (model space, Megatron's fully_reshardable keys)
                    optimizer = _plugin_optimizer(modules, canonical, argv)
                    state_dict["optimizer"] = optimizer.sharded_state_dict(
                        state_dict, metadata=dict(metadata, distrib_optim_sharding_type="fully_reshardable"))
                elif sharding == NON_DISTRIBUTED:
                    optimizer = _megatron_non_distributed_optimizer(modules, canonical, argv)
                    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
                    state_dict["args"].use_distributed_optimizer = False
                elif sharding is not None:
                    if "dist" not in optimizers:
                        optimizers["dist"] = _megatron_distributed_optimizer(modules, canonical, argv)
                    state_dict["optimizer"] = optimizers["dist"].sharded_state_dict(
                        state_dict, metadata=dict(metadata, distrib_optim_sharding_type=sharding))
                dist_checkpointing.save(state_dict, os.path.join(mlm, f"iter_{iteration:07d}"))
                if dist.get_rank() == 0:
                    with open(os.path.join(mlm, TRACKER), "w") as f:
                        f.write(str(iteration))
        dist.barrier()
    finally:
        ps.destroy_model_parallel()


def _write_megatron_lm(ours: str, mlm: str, unknown_value, plugin: bool, te: bool = True) -> None:
    """pretrain_gpt's checkpoint ``ours`` rewritten as Megatron-LM saves one (see the module note). ``plugin``: as
    with the megatron_ext plug-in's optimizer, whose ``state_dict()`` is the common part (``optimizer_state.py``) and
    whose ``save_parameter_state`` writes ``distrib_optim.pt`` with the writer that wrote ``optim.pt`` here;
    otherwise a non-distributed optimizer's entry. ``te``: Transformer Engine's layer names (else the local ones,
    as saved)."""
    from megatron_ext.megatron_lm.optimizer_state import COMMON_FORMAT

    iteration, src, common, saved = _megatron_lm_args(ours)
    saved.update(transformer_impl="transformer_engine" if te else "local", ckpt_format="torch",
                 attention_backend=unknown_value)
    args = argparse.Namespace(**saved)
    for ours_name in sorted(os.listdir(src)):
        if not ours_name.startswith("mp_rank_"):
            continue
        # Megatron-LM leaves the pipeline rank out of the name when PP = 1
        name = ours_name if saved["pipeline_model_parallel_size"] > 1 else ours_name[:len("mp_rank_00")]
        out = os.path.join(mlm, f"iter_{iteration:07d}", name)
        os.makedirs(out)
        model = torch.load(os.path.join(src, ours_name, "model.pt"), weights_only=False)
        optimizer = {"optimizer": {"state": {}}}
        if plugin:
            state = torch.load(os.path.join(src, ours_name, "optim.pt"), weights_only=False)
            state["params"] = {_te_name(k): v for k, v in state["params"].items()}
            torch.save(state, os.path.join(out, "distrib_optim.pt"))
            optimizer = {"format": COMMON_FORMAT, "optimizer": state["optimizer"], "step": state["step"],
                         "param_groups": state["param_groups"], "grad_scaler": state["grad_scaler"]}
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                    "model": _as_transformer_engine(model) if te else model, "optimizer": optimizer,
                    "opt_param_scheduler": common["scheduler"], "rng_state": [{"random_rng_state": None}],
                    "num_floating_point_operations_so_far": 0}, os.path.join(out, "model_optim_rng.pt"))
    with open(os.path.join(mlm, TRACKER), "w") as f:
        f.write(str(iteration))


def _add_megatron_optimizer_state(argv, ours: str, mlms: dict) -> None:
    """Every rank: Megatron's own optimizer holding ``ours``'s state replaces the optimizer of its position of each
    torch-format checkpoint in ``mlms`` (directory -> distributed or not) as Megatron-LM saves it there: the
    DistributedOptimizer (megatron-core's, :func:`_megatron_distributed_optimizer`) its ``state_dict()`` in
    ``model_optim_rng.pt`` and its ``save_parameter_state`` (gathered on DP rank 0) in ``distrib_optim.pt``; the
    non-distributed one (:func:`_megatron_non_distributed_optimizer`) its ``state_dict()`` alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.checkpoint_compat import fit_extra_states
    from megatron_ext.training.initialize import init_model_parallel
    from megatron_ext.training.model import build_model_chunks

    iteration, src, common, _ = _megatron_lm_args(ours)
    args = parse_args(argv)
    init_model_parallel(args)
    try:
        args.padded_vocab_size = common["args"]["padded_vocab_size"]
        (module,) = build_model_chunks(args)
        t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        gpt = getattr(module, "module", module)
        state = torch.load(os.path.join(src, f"mp_rank_{t:02d}_{p:03d}", "model.pt"), weights_only=False)
        gpt.load_state_dict(fit_extra_states(state, gpt), strict=True)
        canonical = torch.load(os.path.join(src, f"mp_rank_{t:02d}_{p:03d}", "optim.pt"), weights_only=False)
        for mlm, distributed in mlms.items():
            out = os.path.join(mlm, f"iter_{iteration:07d}", f"mp_rank_{t:02d}")
            saved = torch.load(os.path.join(out, "model_optim_rng.pt"), weights_only=False)
            with _megatron_core_on_cpu():
                optimizer = (_megatron_distributed_optimizer if distributed else _megatron_non_distributed_optimizer)(
                    [module], canonical, argv)
                saved["optimizer"] = optimizer.state_dict()
                if distributed:
                    optimizer.save_parameter_state(os.path.join(out, "distrib_optim.pt"))
                else:
                    saved["args"].use_distributed_optimizer = False
            if ps.get_data_parallel_rank() == 0:
                torch.save(saved, os.path.join(out, "model_optim_rng.pt"))
            dist.barrier()
    finally:
        ps.destroy_model_parallel()


def _unimportable(tmp_path):
    """An object whose class lives in a module that is gone once it is pickled (another version's enum, say)."""
    (tmp_path / "gone_module.py").write_text("class Gone:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import gone_module
        return gone_module.Gone()
    finally:
        sys.path.remove(str(tmp_path))


def _forget(tmp_path):
    sys.modules.pop("gone_module", None)
    os.remove(tmp_path / "gone_module.py")


def _save_import_resume(base, ours, tmp):
    """Save at TP 2; write it as Megatron-LM would (torch format with the plug-in's optimizer, a non-distributed
    one's and Megatron's DistributedOptimizer's; torch_dist in both optimizer layouts) and import them; then resume
    the original (with and without its optimizer state) and imports beside it."""
    import torch.distributed as dist

    from megatron_ext.training.pretrain_gpt import pretrain

    pretrain(base + ["--train-iters", "4", "--exit-interval", "2", "--save", ours])   # the 4-iteration schedule
    _write_torch_dist(base + ["--train-iters", "4"], ours, {os.path.join(tmp, "mlm_dist"): "dp_reshardable",
                                                             os.path.join(tmp, "mlm_dist_full"): "fully_reshardable",
                                                             os.path.join(tmp, "mlm_dist_nd"): NON_DISTRIBUTED})
    _write_torch_dist(base + ["--train-iters", "4"], ours, {os.path.join(tmp, "mlm_dist_odo"): "odo"})
    if dist.get_rank() == 0:
        from pathlib import Path

        for plugin in (True, False):
            mlm, imported = (os.path.join(tmp, f"{n}_{'plugin' if plugin else 'own'}") for n in ("mlm", "imported"))
            _write_megatron_lm(ours, mlm, _unimportable(Path(tmp)), plugin)
            _forget(Path(tmp))
            assert _tool(["--load", mlm, "--save", imported, "--transformer-impl", "local"]) == 0
        for mlm in ("mlm_dopt", "mlm_ndopt"):
            _write_megatron_lm(ours, os.path.join(tmp, mlm), "sdpa", plugin=False, te=False)
    dist.barrier()
    _add_megatron_optimizer_state(base + ["--train-iters", "4"], ours, {os.path.join(tmp, "mlm_dopt"): True,
                                                                        os.path.join(tmp, "mlm_ndopt"): False})
    if dist.get_rank() == 0:
        for kind in ("dopt", "ndopt"):
            assert _tool(["--load", os.path.join(tmp, f"mlm_{kind}"), "--save", os.path.join(tmp, f"imported_{kind}")
                          ]) == 0
        mlm_dist = os.path.join(tmp, "mlm_dist")
        assert _tool(["--load", mlm_dist, "--save", os.path.join(tmp, "imported_dist")]) == 0
        assert _tool(["--load", mlm_dist + "_full", "--save", os.path.join(tmp, "imported_dist_full")]) == 0
        assert _tool(["--load", mlm_dist + "_nd", "--save", os.path.join(tmp, "imported_dist_nd")]) == 0
        assert _tool(["--load", mlm_dist + "_odo", "--save", os.path.join(tmp, "imported_dist_odo")]) == 0
        assert _tool(["--load", mlm_dist, "--save", os.path.join(tmp, "imported_dist_te"),
                      "--transformer-impl", "transformer_engine"]) == 0
    dist.barrier()
    resume = base + ["--train-iters", "4", "--no-load-rng"]
    no_optim = resume + ["--no-load-optim"]
    plugin, own = os.path.join(tmp, "imported_plugin"), os.path.join(tmp, "imported_own")
    return [pretrain(resume + ["--load", ours]), pretrain(resume + ["--load", plugin]),
            pretrain(no_optim + ["--load", ours]),
            _load_error(resume + ["--load", own]),
            pretrain(resume + ["--load", os.path.join(tmp, "imported_dist")])]


def test_megatron_lm_checkpoint_continues_like_the_original(spawn, text_dataset, tiny_model_flags, tmp_path):
    """Megatron-LM's TP 2 checkpoint (``mp_rank_00``, ``mp_rank_01``; Transformer Engine's names; an ``args`` value
    whose class cannot be imported here) imported for local layers: every weight equals the saving run's bit for bit
    under its local name, and the resume continues at the saved iteration and data position with the original
    checkpoint's losses, bit for bit, with the optimizer state where the megatron_ext plug-in saved it; where a
    non-distributed optimizer did, a resume without --no-load-optim is refused. (PP > 1 names: the model-chunk case of
    test_what_cannot_be_imported_is_refused_by_name.) The same model saved as ``--ckpt-format torch_dist``, with
    megatron-core's own DistributedOptimizer holding the run's Adam state (megatron-core's ``sharded_state_dict``,
    ``dist_checkpointing.save``, as Megatron-LM saves it; buckets small enough that parameters fill several), in its
    default bucket-space layout (dp_reshardable) and in model space (fully_reshardable), and with its non-distributed
    optimizer (Megatron-LM's default; bf16 weights with fp32 main weights, model space; also in the torch format, by
    param-group order), and with the megatron_ext plug-in's ODO (model space, its own header): imported, the weights (for
    local layers, the saving run's, or Transformer Engine's names) and each position's optimizer state (main weights,
    moments, step) equal the original's bit for bit, and the resume continues with the original's losses."""
    base = tiny_model_flags + ["--swiglu"] + _data_flags(text_dataset) + [
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--bf16"]
    ours = str(tmp_path / "ours")
    full, plugin_run, fresh, refusal, dist_run = spawn(_save_import_resume, 2, base, ours, str(tmp_path),
                                                                timeout=240)[-1]
    assert sorted(plugin_run["losses"]) == [3, 4] and plugin_run["consumed_train_samples"] == 32
    assert plugin_run["losses"] == full["losses"]
    assert dist_run["losses"] == full["losses"] and dist_run["consumed_train_samples"] == 32
    assert full["losses"][4] != fresh["losses"][4]   # the optimizer state matters at iteration 4
    assert "imported from Megatron-LM without its optimizer state; resume with --no-load-optim" in refusal, refusal
    assert sorted(os.listdir(tmp_path / "mlm_own" / "iter_0000002")) == ["mp_rank_00", "mp_rank_01"]
    for kind, has_optim in (("plugin", True), ("own", False), ("dist", True)):
        ckpt = os.path.join(tmp_path, f"imported_{kind}", "iter_0000002")
        assert open(os.path.join(tmp_path, f"imported_{kind}", TRACKER)).read() == "2"
        assert verify_checksums(ckpt) > 0 and not os.path.exists(os.path.join(ckpt, "rng"))
        common = torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)
        assert (common["iteration"], common["consumed_train_samples"], common["has_optim"]) == (2, 16, has_optim)
        assert ("attention_backend" in common["args"]) == (kind == "dist")   # (dropped: its class is unimportable)
        assert common["args"]["disable_bias_linear"] is False and common["imported_from"] == os.path.realpath(
            os.path.join(tmp_path, f"mlm_{kind}", "iter_0000002"))
        assert (common["args"]["apply_layernorm_1p"], common["args"]["norm_epsilon"]) == (False, 1e-5)
        for name in ("mp_rank_00_000", "mp_rank_01_000"):
            want = torch.load(os.path.join(ours, "iter_0000002", name, "model.pt"), weights_only=False)
            got = torch.load(os.path.join(ckpt, name, "model.pt"), weights_only=False)
            if kind == "dist":   # torch_dist's extra states are not carried (the modules keep their own)
                want = {k: t for k, t in want.items() if torch.is_tensor(t)}
                te = torch.load(os.path.join(tmp_path, "imported_dist_te", "iter_0000002", name, "model.pt"),
                                weights_only=False)
                assert te.keys() == {_te_name(k) for k in want}
                assert all(torch.equal(t, te[_te_name(k)]) for k, t in want.items())
            assert got.keys() == want.keys() and any("input_layernorm" in k for k in got)
            for k, t in want.items():   # tensors, and the local linear layers' extra states (None)
                same = t.dtype == got[k].dtype and torch.equal(t, got[k]) if torch.is_tensor(t) else got[k] is None
                assert same, k
            assert os.path.exists(os.path.join(ckpt, name, "optim.pt")) == has_optim
    # Megatron's DistributedOptimizer state, torch_dist's two layouts and the torch format's distrib_optim.pt, its
    # non-distributed optimizer's in both formats, and the plug-in's torch_dist one: each position's equals the
    # original's, bit for bit
    for kind in ("dist", "dist_full", "dopt", "dist_nd", "ndopt", "dist_odo"):
        for name in ("mp_rank_00_000", "mp_rank_01_000"):
            want = torch.load(os.path.join(ours, "iter_0000002", name, "optim.pt"), weights_only=False)
            got = torch.load(tmp_path / f"imported_{kind}" / "iter_0000002" / name / "optim.pt", weights_only=False)
            assert (got["format"], got["optimizer"], got["step"]) == (want["format"], want["optimizer"], 2)
            # the groups' keys are the ODO's (the resume matches groups by them)
            assert [g["overrides"] for g in got["param_groups"]] == [g["overrides"] for g in want["param_groups"]]
            assert got["params"].keys() == want["params"].keys()
            for param, entry in want["params"].items():
                assert tuple(got["params"][param]["shape"]) == tuple(entry["shape"])
                for field in ("master", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(got["params"][param][field], entry[field]), (kind, name, param, field)
    # --no-load-optim: the weights alone, whatever optimizer state there is
    for kind in ("dist", "dopt"):
        assert _tool(["--load", str(tmp_path / f"mlm_{kind}"), "--save", str(tmp_path / f"weights_{kind}"),
                      "--no-load-optim"]) == 0
        ckpt = tmp_path / f"weights_{kind}" / "iter_0000002"
        assert torch.load(ckpt / "common.pt", weights_only=False)["has_optim"] is False
        assert not any(n == "optim.pt" for _, _, files in os.walk(ckpt) for n in files)
    # and tools/reshard_checkpoint.py takes it to other TP/PP sizes as it takes the original
    from .test_checkpoint_reshard import _reshard, _tensors

    assert _reshard(str(tmp_path / "imported_plugin"), str(tmp_path / "imported_tp1"), 1, 1) == 0
    assert _reshard(ours, str(tmp_path / "ours_tp1"), 1, 1) == 0
    want, got = (_tensors(os.path.join(tmp_path, d, "iter_0000002")) for d in ("ours_tp1", "imported_tp1"))
    assert got.keys() == want.keys() and any(k.startswith("mp_rank_00_000/optim.pt") for k in got)
    assert all(torch.equal(t, got[k]) for k, t in want.items())
    # imported as it is (Transformer Engine's names, for a TE run), then renamed by the reshard tool for a local run:
    # the same files as the import with --transformer-impl local
    te, te_local = str(tmp_path / "imported_te"), str(tmp_path / "te_local")
    assert _tool(["--load", str(tmp_path / "mlm_plugin"), "--save", te]) == 0
    te_files = _tensors(os.path.join(te, "iter_0000002"))
    assert any("linear_qkv.layer_norm_weight" in k for k in te_files) and any("_extra_state" in k for k in te_files)
    assert _reshard(te, te_local, 2, 1, "--target-transformer-impl", "local") == 0
    want, got = (_tensors(os.path.join(d, "iter_0000002")) for d in (str(tmp_path / "imported_plugin"), te_local))
    assert got.keys() == want.keys() and all(torch.equal(t, got[k]) for k, t in want.items())
    assert torch.load(os.path.join(te_local, "iter_0000002", "common.pt"),
                      weights_only=False)["args"]["transformer_impl"] == "local"
    # a torch_dist checkpoint's tensors do not depend on the saving run's PP size: the same files, as if saved at
    # PP 2, import to the stages the reshard tool gives the original at TP 2 x PP 2 (layers placed, the tied output
    # layer's copy of the embedding on the last stage)
    import shutil

    pp2 = tmp_path / "mlm_dist_pp2" / "iter_0000002"
    shutil.copytree(tmp_path / "mlm_dist", tmp_path / "mlm_dist_pp2")
    saved = torch.load(pp2 / "common.pt", weights_only=False)
    saved["args"].pipeline_model_parallel_size = 2
    del saved["optimizer"]   # (its buckets are the PP 1 positions': weights only)
    torch.save(saved, pp2 / "common.pt")
    assert _tool(["--load", str(tmp_path / "mlm_dist_pp2"), "--save", str(tmp_path / "imported_pp2")]) == 0
    pp2_common = torch.load(tmp_path / "imported_pp2" / "iter_0000002" / "common.pt", weights_only=False)
    assert pp2_common["has_optim"] is False
    assert _reshard(ours, str(tmp_path / "ours_pp2"), 2, 2) == 0
    want, got = (_tensors(str(tmp_path / d / "iter_0000002")) for d in ("ours_pp2", "imported_pp2"))
    want = {k: t for k, t in want.items() if k.split("/")[1] == "model.pt"}
    assert got.keys() == want.keys() and "mp_rank_01_001/model.pt/output_layer.weight" in got
    assert all(torch.equal(t, got[k]) for k, t in want.items())


def _fake_megatron_lm(root, positions=("mp_rank_00",), iteration=5, chunks=None, optimizer=None, **args):
    args = argparse.Namespace(**{"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                 "transformer_impl": "transformer_engine", **args})
    for i, name in enumerate(positions):
        os.makedirs(os.path.join(root, f"iter_{iteration:07d}", name))
        models = {"model": {"embedding.word_embeddings.weight": torch.ones(2)}} if chunks is None else {
            f"model{c}": {"decoder.layers.0.mlp.linear_fc2.weight": torch.full((2,), 10.0 * i + c)} for c in chunks}
        torch.save({"args": args, "iteration": iteration, "optimizer": optimizer, **models},
                   os.path.join(root, f"iter_{iteration:07d}", name, "model_optim_rng.pt"))
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return str(root)


def test_what_cannot_be_imported_is_refused_by_name(tmp_path, capsys):
    def refused(load, *more, save=None):
        assert _tool(["--load", str(load), "--save", str(save or tmp_path / "out"), *more]) == 1
        assert not os.path.exists(tmp_path / "out" / TRACKER)
        return capsys.readouterr().err

    assert "expert-parallel" in refused(_fake_megatron_lm(tmp_path / "moe", ("mp_rank_00_000_001",)))
    half = _fake_megatron_lm(tmp_path / "half", ("mp_rank_00",), tensor_model_parallel_size=2)
    assert "missing: ['mp_rank_01_000']" in refused(half)
    local = _fake_megatron_lm(tmp_path / "local", transformer_impl="local")
    assert "resume with --transformer-impl local" in refused(local, "--transformer-impl", "transformer_engine")
    assert "inside it" in refused(local, save=tmp_path / "local" / "out")
    assert "iter_0000007 does not exist" in refused(local, "--ckpt-step", "7")
    (tmp_path / "untracked").mkdir()
    assert "pass --ckpt-step" in refused(tmp_path / "untracked")
    legacy = _fake_megatron_lm(tmp_path / "legacy")
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
                "iteration": 5, "model": {"language_model.embedding.word_embeddings.weight": torch.ones(2)}},
               os.path.join(legacy, "iter_0000005", "mp_rank_00", "model_optim_rng.pt"))
    assert "legacy (non-megatron-core)" in refused(legacy)
    # model chunks per stage (interleaved pipeline): model0, model1, ... kept as they are, all of them needed
    vpp = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4)
    assert "expected model0..model1" in refused(_fake_megatron_lm(tmp_path / "vp_part", ("mp_rank_00_000",
                                                                                          "mp_rank_00_001"),
                                                                  chunks=(0,), **vpp))
    vp = _fake_megatron_lm(tmp_path / "vp", ("mp_rank_00_000", "mp_rank_00_001"), chunks=(0, 1), **vpp)
    assert _tool(["--load", vp, "--save", str(tmp_path / "vp_out")]) == 0
    stage1 = torch.load(tmp_path / "vp_out" / "iter_0000005" / "mp_rank_00_001" / "model.pt", weights_only=False)
    assert sorted(stage1) == ["model0", "model1"]
    assert stage1["model1"]["decoder.layers.0.mlp.linear_fc2.weight"].tolist() == [11.0, 11.0]
    # models pretrain_gpt does not build, by Megatron-LM's flag (expert parallel size 1 keeps the usual names)
    moe = _fake_megatron_lm(tmp_path / "moe_ep1", num_experts=8, apply_residual_connection_post_layernorm=True)
    err = refused(moe)
    assert "--num-experts (mixture of experts) = 8" in err and "--apply-residual-connection-post-layernorm" in err
    odd = _fake_megatron_lm(tmp_path / "odd")   # a weight of a class this environment cannot import (FP8, say)
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "gone_module.py").write_text("class Gone:\n    pass\n")
    import gone_module
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
                "iteration": 5, "model": {"embedding.word_embeddings.weight": gone_module.Gone()}},
               os.path.join(odd, "iter_0000005", "mp_rank_00", "model_optim_rng.pt"))
    sys.path.remove(str(tmp_path))
    _forget(tmp_path)
    assert "a type this environment cannot import: embedding.word_embeddings.weight" in refused(odd)
    # the megatron_ext plug-in's optimizer: its parameter state must be there and be its own
    from megatron_ext.megatron_lm.optimizer_state import COMMON_FORMAT

    plugin = _fake_megatron_lm(tmp_path / "plugin", optimizer={"format": COMMON_FORMAT, "optimizer": "Adam"})
    assert "distrib_optim.pt is missing" in refused(plugin)
    torch.save({"format": "other"}, tmp_path / "plugin" / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt")
    assert "not the plug-in's canonical Adam state" in refused(plugin)
    # two saves mixed: each position must hold the same iteration
    mixed = _fake_megatron_lm(tmp_path / "mixed", ("mp_rank_00", "mp_rank_01"), tensor_model_parallel_size=2)
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1),
                "iteration": 4, "model": {"embedding.word_embeddings.weight": torch.ones(2)}},
               os.path.join(mixed, "iter_0000005", "mp_rank_01", "model_optim_rng.pt"))
    assert "iteration 4, not 5" in refused(mixed)   # found while writing: the partial directory is gone
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    # a release tracker (iteration 0, as Megatron-LM reads it), and --ckpt-step past the tracker
    release = _fake_megatron_lm(tmp_path / "release")
    os.rename(os.path.join(release, "iter_0000005"), os.path.join(release, "release"))
    (tmp_path / "release" / TRACKER).write_text("release")
    path = os.path.join(release, "release", "mp_rank_00", "model_optim_rng.pt")   # and torch's legacy serialization,
    torch.save(torch.load(path, weights_only=False), path, _use_new_zipfile_serialization=False)   # not mappable
    assert _tool(["--load", release, "--save", str(tmp_path / "release_out")]) == 0
    assert (tmp_path / "release_out" / TRACKER).read_text() == "0"
    two = _fake_megatron_lm(tmp_path / "two", iteration=3)
    _fake_megatron_lm(tmp_path / "two", iteration=7)   # the tracker now names 7
    assert _tool(["--load", two, "--save", str(tmp_path / "two_out"), "--ckpt-step", "3"]) == 0
    assert (tmp_path / "two_out" / TRACKER).read_text() == "3"
    # a pretrain_gpt checkpoint (the import's own output) is not imported again
    assert _tool(["--load", local, "--save", str(tmp_path / "ours")]) == 0
    assert "pretrain_gpt checkpoint already" in refused(tmp_path / "ours")
    assert "already holds checkpoints" in refused(local, save=tmp_path / "ours")


def _fake_torch_dist(root, tensors, iteration=3, **args):
    """A torch_dist checkpoint with these (stored key -> tensor) entries, written by torch's DCP as
    megatron-core's save writes them, and Megatron-LM's ``args`` in ``common.pt``."""
    import torch.distributed.checkpoint as dcp

    ckpt = os.path.join(root, f"iter_{iteration:07d}")
    dcp.save(tensors, checkpoint_id=ckpt, no_dist=True)
    args = argparse.Namespace(**{"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                 "num_layers": 2, "transformer_impl": "local", **args})
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0}, os.path.join(ckpt, "common.pt"))
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(iteration))
    return str(root)


def _save_pipeline_as_torch_dist(base, ours, mlm, imported):
    import torch.distributed as dist

    from megatron_ext.training.pretrain_gpt import pretrain

    pretrain(base + ["--train-iters", "2", "--exit-interval", "1", "--save", ours])   # one step: Adam moments
    _write_torch_dist(base + ["--train-iters", "2"], ours, {mlm: "dp_reshardable", mlm + "_nd": NON_DISTRIBUTED})
    if dist.get_rank() == 0:
        assert _tool(["--load", mlm, "--save", imported]) == 0
        assert _tool(["--load", mlm + "_nd", "--save", imported + "_nd"]) == 0
    dist.barrier()


def test_pipeline_chunks_optimizer_state_imports_bit_for_bit(spawn, text_dataset, tiny_model_flags, tmp_path):
    """The bucket-space layout at PP 2 with 2 model chunks per stage and tied embeddings: each stage's optimizer
    keeps one gradient buffer per chunk (gbuf_idx), and the last stage the output layer's own copy of the embedding
    in a bucket of its own. Imported, every stage's model and optimizer state equals the original's bit for bit; so
    does the non-distributed optimizer's (fp32 weights: each its own main weight; the output layer's state saved as the
    embedding's)."""
    base = tiny_model_flags + _data_flags(text_dataset) + [
        "--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
        "1"]
    base[base.index("--num-layers") + 1] = "4"
    ours, mlm, imported = (str(tmp_path / n) for n in ("ours", "mlm", "imported"))
    spawn(_save_pipeline_as_torch_dist, 2, base, ours, mlm, imported, timeout=240)
    from .test_checkpoint_reshard import _tensors

    want = _tensors(os.path.join(ours, "iter_0000001"))
    want = {k: t for k, t in want.items() if "_extra_state" not in k}
    for d in (imported, imported + "_nd"):
        got = _tensors(os.path.join(d, "iter_0000001"))
        assert got.keys() == want.keys() and "mp_rank_00_001/optim.pt/params/1.output_layer.weight/exp_avg" in got
        assert all(torch.equal(t, got[k]) for k, t in want.items()), d


def test_torch_dist_checkpoints_pretrain_gpt_cannot_build_are_refused_by_name(tmp_path, capsys):
    """(Importing a real one: test_megatron_lm_checkpoint_continues_like_the_original.)"""
    def refused(load):
        assert _tool(["--load", load, "--save", str(tmp_path / "out")]) == 1
        assert not os.path.exists(tmp_path / "out" / TRACKER)
        return capsys.readouterr().err

    layers = {"decoder.layers.mlp.linear_fc2.weight": torch.ones(2, 4, 4), "embedding.word_embeddings.weight":
              torch.ones(8, 4), "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.ones(8, 4)}
    foreign = _fake_torch_dist(tmp_path / "foreign", {**layers, "vision_model.proj.weight": torch.ones(2)})
    assert "tensors pretrain_gpt's GPT model has no place for: vision_model.proj.weight" in refused(foreign)
    stacked = _fake_torch_dist(tmp_path / "stacked", layers, num_layers=3)
    assert "decoder.layers.mlp.linear_fc2.weight has shape (2, 4, 4), not stacked over the --num-layers 3" in \
        refused(stacked)
    per_layer = _fake_torch_dist(tmp_path / "per_layer",
                                 {**layers, "decoder.layers.0.mlp.linear_fc2.bias": torch.ones(4)})
    assert "layers saved one by one (decoder.layers.0.mlp.linear_fc2.bias" in refused(per_layer)
    # saved at TP 2, the row-parallel weight in one piece: not the split the reshard rules know
    unsplit = _fake_torch_dist(tmp_path / "unsplit", layers, tensor_model_parallel_size=2)
    assert "decoder.layers.mlp.linear_fc2.weight was saved split along dims none across its TP 2 ranks" in \
        refused(unsplit)
    moe = _fake_torch_dist(tmp_path / "moe", layers, num_experts=8)
    assert "--num-experts (mixture of experts) = 8" in refused(moe)
    os.remove(os.path.join(moe, "iter_0000003", "common.pt"))
    assert "no common.pt (an incomplete torch_dist save?)" in refused(moe)
    # the optimizer's entries are left (see the import's note); what is read is exactly the model's tensors
    from megatron_ext.training.checkpoint_import_dist import DistSource

    common = {"args": {"num_layers": 2}, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    src = DistSource(os.path.join(_fake_torch_dist(tmp_path / "ok", {**layers, "decoder.layers.mlp.linear_fc2.bias":
                                                                     torch.arange(6.0).reshape(2, 3)}),
                                  "iter_0000003"), common)
    assert list(src.model_keys) == ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                                    "decoder.layers.0.mlp.linear_fc2.bias", "decoder.layers.1.mlp.linear_fc2.weight",
                                    "decoder.layers.1.mlp.linear_fc2.bias"]
    assert torch.equal(src.model_tensor("decoder.layers.1.mlp.linear_fc2.bias"), torch.tensor([3.0, 4.0, 5.0]))
    # the non-distributed optimizer's model-space state: every model tensor's moments, and a bf16 weight's fp32 main
    # weight (an fp32 weight is its own); the step is the one megatron-core saved for all (common_step)
    adam = {"optimizer": {"state": {"common_step": torch.tensor(3.0)}, "param_groups": [{"wd_mult": 1.0,
                                                                                          "betas": (0.9, 0.95)}]}}
    state = {f"optimizer.state.{f}.{k}": t for k, t in layers.items() if not k.startswith("optimizer.")
             for f in ("exp_avg", "exp_avg_sq")}
    nd = _fake_torch_dist(tmp_path / "nd", {**layers, **state})
    src = DistSource(os.path.join(nd, "iter_0000003"), common, adam)
    assert src.optim_header()["step"] == 3
    before_first_step = {"optimizer": {"state": {}, "param_groups": adam["optimizer"]["param_groups"]}}   # no step
    stepless = DistSource(os.path.join(nd, "iter_0000003"), common, {"optimizer": before_first_step})
    assert not stepless.has_optim and "non-distributed optimizer saved no Adam state" in stepless.optim_note
    entry = src.optim_shard(0, 0, "decoder.layers.1.mlp.linear_fc2.weight", "decoder.layers.1.mlp.linear_fc2.weight",
                            1, 0, False)
    assert all(torch.equal(t, torch.ones(4, 4)) for t in entry.values())   # (the fake's tensors are all ones)
    # the DistributedOptimizer's fully_reshardable state: a main weight that is not its weight (megatron-core writes
    # that layout shifted after a gradient buffer's first bucket) stops the import, naming why
    fully = {"optimizer": {"param_state_sharding_type": "fully_reshardable",
                           "param_groups": [{"wd_mult": 1.0, "betas": (0.9, 0.95), "step": 3}]}}
    mains = {f"optimizer.state.param.{k}": t.clone() for k, t in layers.items() if not k.startswith("optimizer.")}
    src = DistSource(os.path.join(_fake_torch_dist(tmp_path / "fr", {**layers, **state, **mains}), "iter_0000003"),
                     common, fully)
    assert src.optim_layout == "fully_reshardable"
    assert all(torch.equal(t, torch.ones(4, 4)) for t in src.optim_shard(0, 0, *["decoder.layers.1.mlp.linear_fc2."
                                                                                 "weight"] * 2, 1, 0, False).values())
    mains["optimizer.state.param.decoder.layers.mlp.linear_fc2.weight"][1, 2, 3] = 2.0
    src = DistSource(os.path.join(_fake_torch_dist(tmp_path / "fr_shifted", {**layers, **state, **mains}),
                                  "iter_0000003"), common, fully)
    src.optim_shard(0, 0, *["decoder.layers.0.mlp.linear_fc2.weight"] * 2, 1, 0, False)   # (layer 0 is right)
    with pytest.raises(CheckpointError, match=r"decoder.layers.1.mlp.linear_fc2.weight \(TP rank 0\): its main weights "
                                              r"are not its weights: megatron-core up to 0.19 writes"):
        src.optim_shard(0, 0, *["decoder.layers.1.mlp.linear_fc2.weight"] * 2, 1, 0, False)
    del state["optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"]
    nd = _fake_torch_dist(tmp_path / "nd_short", {**layers, **state})
    with pytest.raises(CheckpointError, match="non-distributed optimizer state without optimizer.state.exp_avg_sq."
                                              "embedding.word_embeddings.weight"):
        DistSource(os.path.join(nd, "iter_0000003"), common, adam)
    bf16 = {k: t.bfloat16() for k, t in layers.items() if not k.startswith("optimizer.")}
    nd = _fake_torch_dist(tmp_path / "nd_bf16", {**bf16, **state, "optimizer.state.exp_avg_sq.embedding."
                                                 "word_embeddings.weight": torch.ones(8, 4)})
    with pytest.raises(CheckpointError, match="without optimizer.state.fp32_param.decoder.layers.mlp.linear_fc2"):
        DistSource(os.path.join(nd, "iter_0000003"), common, adam)
    # a TP rank's shard, read as a slice, is the reshard rules' split of the whole tensor (a fused SwiGLU fc1's gate
    # and up rows; a row-parallel weight's columns)
    from megatron_ext.training.checkpoint_reshard import split_tp

    fc = {"decoder.layers.mlp.linear_fc1.weight": torch.arange(2 * 8 * 3.0).reshape(2, 8, 3),
          "decoder.layers.mlp.linear_fc2.weight": torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)}
    src = DistSource(os.path.join(_fake_torch_dist(tmp_path / "fc", fc), "iter_0000003"), common)
    for g in ("decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"):
        for swiglu in (True, False):
            for rank in (0, 1):
                want = split_tp(g, src.model_tensor(g), 2, rank, swiglu)
                assert torch.equal(src.model_shard(g, 2, rank, swiglu), want), (g, swiglu, rank)


def test_bucket_walk_places_parameters_by_their_main_weights():
    """dp_reshardable buckets: the parameter at an offset is the expected one if its weight equals the main weights
    there (cast to the weight's dtype), else the only other one whose weight does; none, or several equal ones that
    the order cannot vouch for, are refused (the import then names the bucket)."""
    from megatron_ext.training.checkpoint_import_optim import _place

    weights = {(0, "a"): torch.tensor([1.0, 2.0, 3.0]).to(torch.bfloat16), (0, "b"): torch.tensor([[4.0, 7.0]]),
               (0, "c"): torch.tensor([4.0, 5.0, 6.0]), (0, "d"): torch.tensor([4.0, 5.0, 6.0])}
    main = torch.tensor([4.0, 5.0, 6.0, 0.0, 1.0, 2.0, 3.0 + 2 ** -10])   # c (or d), padding, a (3 in bf16)
    assert _place(main, 4, 8, [(0, "a"), (0, "b")], weights) == (0, "a")
    assert _place(main, 4, 8, [(0, "b"), (0, "a")], weights) == (0, "a")   # not the expected one, but the only one
    assert _place(main, 4, 6, [(0, "a")], weights) == []   # a would run past the bucket's end
    assert _place(main, 3, 8, [(0, "a"), (0, "b")], weights) == []
    assert _place(main, 0, 8, [(0, "c"), (0, "d")], weights) == (0, "c")   # equal weights: the order decides
    assert _place(main, 0, 8, [(0, "b"), (0, "c"), (0, "d")], weights) == [(0, "c"), (0, "d")]
    assert _place(main, 0, 8, [(0, "c"), (0, "d")], weights, trusted=False) == [(0, "c"), (0, "d")]


def _registered_local_gpt():
    """The parameter names megatron-core's GPT with the local layer spec (biases, q/k layer norms) registers, in
    order."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.compat import enable_cpu_compat
    from megatron_ext.models.gpt import make_gpt_config

    from ..test_utilities import Utils

    enable_cpu_compat()
    Utils.initialize_model_parallel(1, 1)
    try:
        gpt = GPTModel(config=make_gpt_config(2, 32, 4, add_bias_linear=True, qk_layernorm=True),
                       transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=64,
                       max_sequence_length=16)
        return [n for n, _ in gpt.named_parameters()]
    finally:
        Utils.destroy_model_parallel()


def test_coalesced_buckets_walk_across_unaligned_bucket_ends():
    """The torch format's distrib_optim.pt holds a gradient buffer's buckets back to back, each cut at its unpadded
    end: after a bucket that ends off the 64-element grid the next parameter starts right there, inside a bucket the
    walk places it in as it does 64-aligned ones."""
    from megatron_ext.training.checkpoint_import_optim import walk_buffer

    # reverse registration order: c (70 elements, then padding to 128) and b (30, a bucket's end at 158), a (100)
    w = {(0, "a"): torch.arange(100.0), (0, "b"): torch.arange(30.0) + 500, (0, "c"): torch.arange(70.0) + 900}
    main = torch.cat([w[0, "c"], torch.zeros(58), w[0, "b"], w[0, "a"]])
    fields = {"master": main, "exp_avg": main * 2, "exp_avg_sq": main * 3}
    out = walk_buffer(fields, [(0, "c"), (0, "b"), (0, "a")], w, True, "buffer", "here", coalesced=True)
    assert all(torch.equal(out[k]["master"], t) and torch.equal(out[k]["exp_avg_sq"], 3 * t) for k, t in w.items())
    with pytest.raises(CheckpointError, match="no parameter of here fit the main weights at element 192"):
        walk_buffer(fields, [(0, "c"), (0, "b"), (0, "a")], w, True, "buffer", "here")   # one bucket: not aligned
    # a bucket of 70 elements, then one of two all-ones weights: the first also fits 64-aligned (over both), which
    # leaves no room for the second; the walk goes back and starts the bucket at 70
    w = {(0, "a"): torch.arange(70.0) + 1, (0, "b"): torch.ones(64), (0, "c"): torch.ones(64)}
    main = torch.cat([w[0, "a"], torch.ones(128)])
    out = walk_buffer({"master": main, "exp_avg": torch.arange(198.0), "exp_avg_sq": main}, [(0, "a"), (0, "b"),
                      (0, "c")], w, True, "buffer", "here", coalesced=True)
    assert [out[0, k]["exp_avg"][0].item() for k in "abc"] == [0.0, 70.0, 134.0]


def test_header_carries_step_groups_and_dynamic_loss_scale():
    """The DistributedOptimizer's ``state_dict()``: the step its param groups record, the groups without it, and an
    fp16 run's dynamic loss scale in pretrain_gpt's scaler's terms (a constant scaler's empty state gives none)."""
    from megatron_ext.training.checkpoint_import_optim import canonical_header

    groups = [{"wd_mult": 1.0, "lr_mult": 1.0, "lr": 0.1, "step": 7, "params": [0]}, {"wd_mult": 0.0, "step": 7}]
    scaler = {"scale": torch.tensor([1024.0]), "growth_tracker": 3, "hysteresis_tracker": 1}
    header = canonical_header({"optimizer": {"param_groups": groups}, "grad_scaler": scaler}, "here")
    assert (header["optimizer"], header["step"]) == ("AdamW", 7)
    assert header["param_groups"] == [{"wd_mult": 1.0, "lr_mult": 1.0, "lr": 0.1}, {"wd_mult": 0.0}]
    assert header["grad_scaler"] == {"scale": 1024.0, "growth_tracker": 3, "hysteresis_tracker": 1}
    assert canonical_header({"optimizer": {"param_groups": groups}, "grad_scaler": {}}, "here")["grad_scaler"] is None
    with pytest.raises(CheckpointError, match="give the steps \\[6, 7\\], not one: import with --no-load-optim"):
        canonical_header({"optimizer": {"param_groups": groups + [{"step": 6}]}}, "here")


def _main(weight: torch.Tensor, mixed: bool) -> torch.Tensor:
    return weight.float() * (1 + 2 ** -12) if mixed else weight


def _non_distributed_saved(chunk: dict, groups: list, mixed: bool, **args) -> dict:
    """``model_optim_rng.pt`` as Megatron's non-distributed optimizer saves it (torch format) for the weights
    ``chunk``: torch Adam's ``state_dict()`` over the param groups ``groups`` ((wd_mult, names) in order: indices
    counted across the groups), exp_avg = 2 x and exp_avg_sq = 3 x the fp32 main weight; ``mixed``: a bf16 run's
    Float16Optimizer (main weights saved group by group, off the weights by a 4096th of them, which casts back to
    the bf16 weights), else FP32Optimizer (the weights are the main weights)."""
    state, param_groups, masters, index = {}, [], [], 0
    for wd_mult, names in groups:
        mains = [_main(chunk[n], mixed) for n in names]
        for main in mains:
            state[index] = {"step": torch.tensor(5.0), "exp_avg": 2 * main, "exp_avg_sq": 3 * main}
            index += 1
        param_groups.append({"wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False, "lr": 0.1,
                             "betas": (0.9, 0.95), "params": list(range(index - len(names), index))})
        masters.append(mains)
    adam = {"state": state, "param_groups": param_groups}
    scaler = {"scale": torch.tensor([1024.0]), "growth_tracker": 3, "hysteresis_tracker": 1}   # (as fp16's)
    optimizer = {"optimizer": adam, "grad_scaler": scaler, "fp32_from_fp16_params": masters} if mixed else adam
    return {"args": argparse.Namespace(**args), "optimizer": optimizer}


def test_non_distributed_state_is_placed_by_param_group_order_and_proved(tmp_path):
    """Megatron's non-distributed optimizers (torch format): a param group's j-th index is the j-th parameter of its
    weight decay in registration order (biases, 1-D tensors without; with --apply-wd-to-qk-layernorm q/k layer norms
    with), each proved by its shape and, in bf16, by its fp32 main weight cast back; groups of other learning rates
    are not read, and a state that does not fit is refused, naming the parameter."""
    from megatron_ext.training.checkpoint_import import _local_to_te_name
    from megatron_ext.training.checkpoint_import_optim import torch_format_state

    layer = "decoder.layers.0."
    shapes = {"embedding.word_embeddings.weight": (8, 4), layer + "input_layernorm.weight": (4,),
              layer + "self_attention.linear_proj.weight": (4, 4), layer + "self_attention.linear_qkv.weight": (12, 4),
              layer + "self_attention.linear_qkv.bias": (12,), layer + "self_attention.q_layernorm.weight": (4,),
              "decoder.final_layernorm.weight": (4,)}
    g = torch.Generator().manual_seed(0)
    names = list(shapes)   # (registration order)
    wd = [names[0], names[2], names[3]]
    no_wd = [names[1], names[4], names[5], names[6]]
    path = str(tmp_path / "model_optim_rng.pt")
    for mixed, prefix in ((True, "module."), (False, "")):
        chunk = {n: torch.randn(shape, generator=g).to(torch.bfloat16 if mixed else torch.float32)
                 for n, shape in shapes.items()}

        def read(saved, chunks=(chunk,)):
            args = vars(saved["args"]) if "args" in saved else {}
            return torch_format_state(saved, path, list(chunks), _local_to_te_name, False, prefix, args)

        for apply, groups in ((False, [(1.0, wd), (0.0, no_wd)]),
                              (True, [(1.0, wd + [names[5]]), (0.0, [n for n in no_wd if n != names[5]])])):
            state, whose = read(_non_distributed_saved(chunk, groups, mixed, apply_wd_to_qk_layernorm=apply))
            assert whose == "Megatron's non-distributed" and (state["step"], state["optimizer"]) == (5, "AdamW")
            assert state["grad_scaler"] == ({"scale": 1024.0, "growth_tracker": 3, "hysteresis_tracker": 1}
                                            if mixed else None)
            assert [grp["wd_mult"] for grp in state["param_groups"]] == [1.0, 0.0]
            assert state["params"].keys() == {prefix + n for n in names}
            for n, w in chunk.items():
                main = _main(w, mixed)
                entry = state["params"][prefix + n]
                assert entry["shape"] == w.shape and torch.equal(entry["master"], main.reshape(-1))
                assert torch.equal(entry["exp_avg_sq"], 3 * main.reshape(-1))
        # the groups in the other order (megatron-core sorts them by their overrides; older versions did not)
        state, _ = read(_non_distributed_saved(chunk, [(0.0, no_wd), (1.0, wd)], mixed))
        assert torch.equal(state["params"][prefix + names[3]]["exp_avg"], 2 * _main(chunk[names[3]], mixed).reshape(-1))
        # a parameter in the other group than the rule puts it: the counts differ
        with pytest.raises(CheckpointError, match="param group 0 holds 4 parameters, the model 3 of its overrides"):
            read(_non_distributed_saved(chunk, [(1.0, wd + [names[6]]), (0.0, no_wd[:-1])], mixed))
        # two [4]-shaped layer norms swapped in their group: the main weights (bf16) tell; fp32 carries the weights
        swapped = _non_distributed_saved(chunk, [(1.0, wd), (0.0, [no_wd[0], no_wd[1], no_wd[3], no_wd[2]])], mixed)
        if mixed:
            with pytest.raises(CheckpointError, match="parameter 5 \\(param group 1\\) is not "
                                                      "decoder.layers.0.self_attention.q_layernorm.weight's state"):
                read(swapped)
        with pytest.raises(CheckpointError, match="parameter 1 \\(param group 0\\) is not "
                                                  "decoder.layers.0.self_attention.linear_proj.weight's state"):
            read(_non_distributed_saved(chunk, [(1.0, [wd[0], wd[2], wd[1]]), (0.0, no_wd)], mixed))   # shapes
        # --decoupled-lr: the word embeddings in a group of their own (megatron-core before 0.16 marks it)
        decoupled = _non_distributed_saved(chunk, [(1.0, wd[1:]), (0.0, no_wd), (1.0, wd[:1])], mixed,
                                           decoupled_lr=0.01)
        (decoupled["optimizer"]["optimizer"] if mixed else decoupled["optimizer"])["param_groups"][2][
            "is_decoupled_lr"] = True
        state, _ = read(decoupled)
        assert [grp["overrides"] for grp in state["param_groups"]] == [None, (("wd_mult", 0.0),), (("max_lr", 0.01),)]
        assert torch.equal(state["params"][prefix + names[0]]["exp_avg"], 2 * _main(chunk[names[0]], mixed).reshape(-1))
        del decoupled["args"].decoupled_lr   # (the run's flags say no group of its own: where would its state be?)
        with pytest.raises(CheckpointError, match="param group 0 holds 2 parameters, the model 3 of its overrides"):
            read(decoupled)
        scaled = _non_distributed_saved(chunk, [(1.0, wd), (0.0, no_wd)], mixed)
        (scaled["optimizer"]["optimizer"] if mixed else scaled["optimizer"])["param_groups"][0]["lr_mult"] = 2.0
        assert read(scaled) == (None, "Megatron's non-distributed optimizer has param groups with a learning-rate "
                                      "multiplier or expert parallelism: not read")
        sgd = _non_distributed_saved(chunk, [(1.0, wd), (0.0, no_wd)], mixed)
        for grp in (sgd["optimizer"]["optimizer"] if mixed else sgd["optimizer"])["param_groups"]:
            del grp["betas"]
        assert read(sgd) == (None, "Megatron's non-distributed optimizer is not Adam (only Adam's state is read)")
        with pytest.raises(CheckpointError, match="decoder.layers.0.self_attention.new.weight is not in "
                                                  "megatron-core's registration order"):   # (where is its state?)
            read(_non_distributed_saved(chunk, groups, mixed), [{**chunk, layer + "self_attention.new.weight":
                                                                 chunk[names[3]]}])
        groups = [{"wd_mult": 1.0, "betas": (0.9, 0.95), "params": []}]
        assert read({"optimizer": {"optimizer": {"state": {}, "param_groups": groups}}})[1] == (
            "Megatron's non-distributed optimizer saved no Adam state (saved before its first step?)")
        assert read({"optimizer": {"optimizer": {"param_groups": groups}}})[1] == (   # (a DistributedOptimizer's)
            f"no {tmp_path / 'distrib_optim.pt'}: the DistributedOptimizer's parameter state is missing")


def _megatron_core_non_distributed_saves(cases):
    """Rank body (world of 1): for each (bf16, saving run's args, model chunks), megatron-core's GPT (local spec,
    biases, q/k layer norms, untied output layer; every weight random, so each is told apart; as several model chunks,
    whole models here, which the optimizer takes in order all the same) under its own DDP and non-distributed
    optimizer, Adam's state set to exp_avg = 2 x and exp_avg_sq = 3 x each fp32 main weight; returns what Megatron-LM's
    torch format saves of it (the chunks' state dicts; ``model_optim_rng.pt``'s ``args`` and ``optimizer``) and each
    param group's key as megatron-core's standard overrides give its parameters."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import (OptimizerConfig, combine_param_group_overrides, get_megatron_optimizer,
                                         get_standard_config_overrides)
    from megatron.core.optimizer_param_scheduler import param_group_override_to_tuple
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.compat import enable_cpu_compat
    from megatron_ext.models.gpt import make_gpt_config

    from ..test_utilities import Utils

    enable_cpu_compat()
    out = []
    for bf16, args, n_chunks in cases:
        Utils.initialize_model_parallel(1, 1)
        try:
            torch.manual_seed(1)
            gpts = [GPTModel(config=make_gpt_config(2, 32, 4, add_bias_linear=True, qk_layernorm=True, bf16=bf16),
                             transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=64,
                             max_sequence_length=16, share_embeddings_and_output_weights=False)
                    for _ in range(n_chunks)]
            with torch.no_grad():
                for p in (p for gpt in gpts for p in gpt.parameters()):
                    p.copy_(torch.randn_like(p))
            with _megatron_core_on_cpu():
                ddps = [DistributedDataParallel(gpt.config, DistributedDataParallelConfig(),
                                                Float16Module(gpt.config, gpt) if bf16 else gpt) for gpt in gpts]
                config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, bf16=bf16, **args)
                optimizer = get_megatron_optimizer(config, ddps)
                (inner,) = optimizer.chained_optimizers
                for group in inner.optimizer.param_groups:
                    for main in group["params"]:
                        inner.optimizer.state[main].update(step=torch.tensor(3.0), exp_avg=2 * main.detach(),
                                                           exp_avg_sq=3 * main.detach())
                # each group's key, from its first parameter's name (megatron-core's own matching)
                model_of = {id(main): p for mains, model in zip(getattr(inner, "fp32_from_float16_groups", []),
                                                                 getattr(inner, "float16_groups", []))
                            for main, p in zip(mains, model)}
                name_of = {id(p): n for ddp in ddps for n, p in ddp.module.named_parameters()}
                overrides = get_standard_config_overrides(config)
                keys = []
                for group in inner.optimizer.param_groups:
                    p = model_of.get(id(group["params"][0]), group["params"][0])
                    matched = [o for k, o in overrides.items() if k.matches(p, name_of[id(p)])]
                    keys.append(param_group_override_to_tuple(combine_param_group_overrides(matched))
                                if matched else None)
                out.append(([gpt.state_dict() for gpt in gpts], {"args": argparse.Namespace(**args),
                                                                 "optimizer": optimizer.state_dict()}, keys))
        finally:
            Utils.destroy_model_parallel()
    return out


def test_non_distributed_state_follows_megatron_cores_param_groups(spawn, tmp_path):
    """megatron-core's own non-distributed optimizers (FP32Optimizer; Float16OptimizerWithFloat16Params with
    --apply-wd-to-qk-layernorm and --decoupled-lr, over two model chunks) on a GPT with biases, q/k layer norms
    and an untied output layer, every weight distinct: the torch format's state, read by param-group index, gives each
    parameter its own moments (2 x and 3 x its main weight), and each group the key megatron-core's overrides give its
    parameters (the one the resume matches groups by)."""
    from megatron_ext.training.checkpoint_import import _local_to_te_name
    from megatron_ext.training.checkpoint_import_optim import torch_format_state

    cases = [(False, {}, 1), (True, {"apply_wd_to_qk_layernorm": True, "decoupled_lr": 0.01,
                                     "decoupled_min_lr": 0.001}, 2)]
    for (bf16, args, _), (chunks, saved, keys) in zip(cases, spawn(_megatron_core_non_distributed_saves, 1,
                                                                    cases)[0]):
        prefix = "module." if bf16 else ""
        state, whose = torch_format_state(saved, str(tmp_path / "model_optim_rng.pt"), chunks, _local_to_te_name,
                                          False, prefix, args)
        assert whose == "Megatron's non-distributed" and state["step"] == 3
        assert [g["overrides"] for g in state["param_groups"]] == keys and len(set(keys)) == len(keys) >= 2
        assert ((("max_lr", 0.01), ("min_lr", 0.001)) in keys) == ("decoupled_lr" in args)
        weights = {prefix + k if len(chunks) == 1 else f"{c}.{prefix}{k}": t for c, chunk in enumerate(chunks)
                   for k, t in chunk.items() if torch.is_tensor(t) and not k.endswith("_extra_state")}
        assert state["params"].keys() == weights.keys() and any("q_layernorm" in k for k in weights)
        for key, weight in weights.items():
            entry = state["params"][key]
            main = entry["master"].view(weight.shape)
            assert torch.equal(main.to(weight.dtype), weight), key
            assert torch.equal(entry["exp_avg"], 2 * entry["master"]) and torch.equal(entry["exp_avg_sq"],
                                                                                      3 * entry["master"]), key


def test_registration_order_is_megatron_cores(spawn):
    """The walk's expected order: megatron-core's GPT with the local layer spec registers its parameters in the order
    registration_order gives their torch_dist names (the Transformer Engine order differs only by the fused layer
    norms, which its LayerNormLinear registers before its weight: see the table)."""
    from megatron_ext.training.checkpoint_import import te_to_local_names
    from megatron_ext.training.checkpoint_import_optim import order_is_known, registration_order

    stored = []   # torch_dist's names: the local spec maps its layer norms to Transformer Engine's
    for name in spawn(_registered_local_gpt, 1)[0]:
        for te, local in te_to_local_names():
            name = name.replace("." + local, "." + te)
        stored.append(name)
    shuffled = [(0, k, k) for k in reversed(stored)]
    assert registration_order(shuffled, te_saved=False) == [(0, k) for k in stored]
    assert any("q_layernorm" in k for k in stored) and any("linear_qkv.layer_norm_bias" in k for k in stored)
    assert order_is_known(shuffled) and not order_is_known(shuffled + [(0, "decoder.layers.0.new.weight", "")])


def test_te_names_map_to_megatron_core_local_names():
    """The renames come from megatron-core's local layer spec; they touch layer norms only, inside any prefix."""
    renames = te_to_local_names()
    assert sorted(renames) == sorted((te, local) for local, te in TE_NAMES.items())
    state = {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": 1,
             "decoder.layers.3.self_attention.linear_qkv.weight": 2,
             "decoder.layers.3.mlp.linear_fc1.layer_norm_bias": 3,
             "decoder.layers.3.mlp.linear_fc1._extra_state": 4,
             "decoder.layers.3.self_attention.core_attention._extra_state": 6,
             "decoder.final_layernorm.weight": 5}
    assert rename_for_local(state, renames) == {"decoder.layers.3.input_layernorm.weight": 1,
                                                "decoder.layers.3.self_attention.linear_qkv.weight": 2,
                                                "decoder.layers.3.pre_mlp_layernorm.bias": 3,
                                                "decoder.layers.3.mlp.linear_fc1._extra_state": None,
                                                "decoder.final_layernorm.weight": 5}
    with pytest.raises(CheckpointError, match="choose one of"):
        import_megatron_lm_checkpoint("x", "y", transformer_impl="te")


def test_extra_states_fit_the_model_and_other_layer_names_are_named():
    """A load keeps tensors strict but fits ``_extra_state`` entries to the model (Transformer Engine's final norm is
    built wherever it is installed); names of the other --transformer-impl get a hint naming the flag."""
    from megatron_ext.training.checkpoint_compat import check_model_state, fit_extra_states

    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return "mine"

        def set_extra_state(self, state):
            self.got = state

    model = torch.nn.Sequential(WithExtra(2, 2), torch.nn.Linear(2, 2))
    saved = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}   # no extra state saved
    saved["1._extra_state"] = "theirs"                                                     # one this model lacks
    assert check_model_state(saved, model) == []
    assert check_model_state({**saved, "0._extra_state": torch.zeros(57, dtype=torch.uint8)}, model) == []  # FP8's
    fitted = fit_extra_states(saved, model)
    assert fitted["0._extra_state"] == "mine" and "1._extra_state" not in fitted
    model.load_state_dict(fitted, strict=True)
    assert model[0].got == "mine"
    del saved["0.bias"]
    assert check_model_state(saved, model) == ["missing from the checkpoint: 0.bias"]   # tensors stay strict
    te = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(2)}

    class Local(torch.nn.Module):
        def state_dict(self, *a, **kw):
            return {"decoder.layers.0.input_layernorm.weight": torch.ones(2)}

    problems = check_model_state(te, Local())
    assert any("named for another --transformer-impl" in p for p in problems), problems
