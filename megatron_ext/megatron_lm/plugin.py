"""Plug the OverlappedDistributedOptimizer into a Megatron-LM checkout's own training loop.

The pip package ``megatron-core`` has no optimizer hook; ``megatron/training/training.py`` (only in a Megatron-LM
checkout) builds the DDP wrapper from its module-global ``DDP`` and the optimizer from its module-global
``get_megatron_optimizer``. :func:`install` rebinds both (and teaches ``unwrap_model`` about the new wrapper); each
replacement defers to the original unless ``--use-overlapped-distributed-optimizer`` was given, so an installed
plug-in changes nothing for runs that do not ask for it. A user adds two lines to their ``pretrain_gpt.py``::

    import megatron_ext.megatron_lm as mxlm; mxlm.install()            # after the imports
    pretrain(..., extra_args_provider=mxlm.add_args)                    # or mxlm.chain(your_provider)

Limits: ``--param-shard-size``, ``--hpz-partition-size``, ``--ladder-residual``, ``--ladder-residual-layers`` and
``--desync-residual`` are rejected by name when parsed (the checkout builds its own model; these work in
``python -m megatron_ext.training.pretrain_gpt``; ZeRO-3 through the plug-in has not been run on a checkout).
``--auto-plan`` (and its ``--plan-*`` options) is rejected the same way: the checkout pads its vocabulary after
parsing, and the planner may choose parameter sharding; print a plan with ``python -m megatron_ext.planner`` and pass
its flags.
From Megatron-LM's side: ``--use-distributed-optimizer`` is required and ``--ckpt-format`` is ``torch_dist`` (its
default: the optimizer state in model space, Megatron's ``fully_reshardable`` layout, through megatron-core
dist-checkpointing; any DP, TP or PP size resumes it) or ``torch`` (canonical per-parameter layout through Megatron-LM's
``save_parameter_state``, see optimizer_state.py; any DP size). ``--gradient-accumulation-fusion`` is switched off.
``install()`` also has the checkpointing module's torch_dist loads note their directory, from which Megatron's own
``dp_reshardable`` optimizer state is read (bucket_state.py).
"""
from __future__ import annotations

import argparse
import importlib
from typing import Any, Callable, Dict, Optional

from megatron_ext.training.arguments import (ArgumentError, add_auto_plan_args, add_megatron_ext_args,
                                            check_megatron_lm_args, qgz_stages_config)

_ORIGINALS: Dict[str, Any] = {}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron-LM's ``pretrain``: adds this project's flags, checked when parsed.

    [Note: validation before initialisation]
    Megatron-LM has no hook to validate extra flags, and its ``validate_args`` does not know ours. So the parser's
    ``parse_known_args`` (which ``parse_args`` calls too) is wrapped to run :func:`check_megatron_lm_args` on the
    result: a flag the plug-in cannot honour (``--hpz-partition-size``, ``--ladder-residual``,
    ``--ladder-residual-layers``, ``--desync-residual``, ``--auto-plan`` and its ``--plan-*`` options) or a bad
    backend combination exits with argparse's usage message naming it and the reason, on every rank alike, before
    ``torch.distributed`` is initialised.
    """
    add_megatron_ext_args(parser)
    add_auto_plan_args(parser)      # known, so that they are rejected with the reason rather than "unrecognized"
    parse_known = parser.parse_known_args
    if getattr(parse_known, "_megatron_ext", False):
        return parser

    def parse_known_args(args=None, namespace=None):
        ns, extra = parse_known(args, namespace)
        try:
            check_megatron_lm_args(ns)
            _adapt_megatron_lm_args(ns)
        except ArgumentError as e:
            parser.error(str(e))
        return ns, extra

    parse_known_args._megatron_ext = True  # type: ignore[attr-defined]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    return parser


# Megatron-LM's own flags whose behaviour the ODO does not implement: (dest, flag, values that are fine, why).
# Refused when the flags are parsed, rather than accepted and ignored.
MEGATRON_LM_FLAGS_NOT_WITH_ODO = (
    ("num_experts", "--num-experts", (None,), "expert parameters need their own expert-data-parallel reduction, "
     "which the ODO does not implement (it would average different experts together)"),
    ("context_parallel_size", "--context-parallel-size", (1, None), "the ODO's plan is sized on the data-parallel "
     "group without context parallelism"),
    ("ddp_num_buckets", "--ddp-num-buckets", (None,), "give the bucket size instead (--ddp-bucket-size)"),
    ("grad_reduce_in_bf16", "--grad-reduce-in-bf16", (False, None), "the ODO reduces bf16/fp16 gradients in fp32"),
    ("use_precision_aware_optimizer", "--use-precision-aware-optimizer", (False, None), "the ODO keeps fp32 "
     "masters and states"),
    ("optimizer_cpu_offload", "--optimizer-cpu-offload", (False, None), "the ODO keeps its states on the device"),
    ("main_params_dtype", "--main-params-dtype", ("fp32", None), "the ODO's masters are fp32"),
    ("check_for_large_grads", "--check-for-large-grads", (False, None), "not implemented by the ODO"),
    ("ddp_average_in_collective", "--ddp-average-in-collective", (False, None), "the ODO averages once, in its own "
     "reduction"),
    ("non_persistent_ckpt_type", "--non-persistent-ckpt-type", (None, "global"), "Megatron-LM's local "
     "non-persistent checkpoints take its DistributedOptimizer's bucket layout only (global ones work)"),
)


def _adapt_megatron_lm_args(ns: argparse.Namespace) -> None:
    """Megatron-LM settings the ODO needs, checked (or switched off, with a note) when the flags are parsed.

    * ``--use-distributed-optimizer``: Megatron-LM calls ``save_parameter_state`` / ``load_parameter_state`` only
      then; without it the DP shards of the optimizer state would silently not be saved.
    * ``--ckpt-format torch_dist`` (Megatron-LM's default) or ``torch``; with torch_dist the ODO saves in model
      space, so ``--dist-ckpt-optim-fully-reshardable`` is switched on (with a note): the checkpoint's metadata then
      says what it holds, and Megatron-LM lets it resume at other TP/PP sizes.
    * ``--gradient-accumulation-fusion`` (Megatron-LM's default when apex/TE are present) writes weight gradients
      into ``param.main_grad``, which a gradient-freeing optimizer does not keep: it is switched off.
    """
    if not _enabled(ns):
        return
    for dest, flag, fine, reason in MEGATRON_LM_FLAGS_NOT_WITH_ODO:
        if hasattr(ns, dest) and getattr(ns, dest) not in fine:
            raise ArgumentError(f"{flag} is not supported with --use-overlapped-distributed-optimizer: {reason}")
    if hasattr(ns, "use_distributed_optimizer") and not ns.use_distributed_optimizer:
        raise ArgumentError("--use-overlapped-distributed-optimizer in a Megatron-LM checkout needs "
                            "--use-distributed-optimizer (Megatron-LM saves a sharded optimizer's state only then)")
    fmt = getattr(ns, "ckpt_format", "torch")
    if fmt not in ("torch", "torch_dist"):
        raise ArgumentError(f"--use-overlapped-distributed-optimizer saves with --ckpt-format torch_dist or torch "
                            f"(got {fmt})")
    if fmt == "torch_dist" and not getattr(ns, "dist_ckpt_optim_fully_reshardable", True):
        import sys

        print("megatron_ext: --use-overlapped-distributed-optimizer saves its torch_dist optimizer state in model "
              "space: --dist-ckpt-optim-fully-reshardable is switched on (the checkpoint says so, and resumes at "
              "other TP/PP sizes)", file=sys.stderr)
        ns.dist_ckpt_optim_fully_reshardable = True
    if getattr(ns, "gradient_accumulation_fusion", False):
        import sys

        print("megatron_ext: --use-overlapped-distributed-optimizer switches off --gradient-accumulation-fusion "
              "(fused weight-gradient accumulation writes param.main_grad, which the ODO does not keep)",
              file=sys.stderr)
        ns.gradient_accumulation_fusion = False


def chain(provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None
          ) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``provider`` (if any) and then :func:`add_args`."""
    def both(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser) or parser
        return add_args(parser)
    return both


def _megatron_args() -> Any:
    return importlib.import_module("megatron.training.global_vars").get_args()


def _enabled(args: Any) -> bool:
    return bool(getattr(args, "use_overlapped_distributed_optimizer", False))


def overlap_config_from_megatron_args(args: Any):
    """OverlapConfig from Megatron-LM's parsed args (its own names plus ours from :func:`add_args`).

    Raises ValueError naming the flag for what the plug-in cannot honour (see :func:`check_megatron_lm_args`).
    """
    import megatron_ext as mx
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.training.arguments import dp_ranks_per_node, sharding_plan_from_args

    try:
        check_megatron_lm_args(args)
    except ArgumentError as e:
        raise ValueError(str(e)) from None
    dp = ps.get_data_parallel_world_size()
    view = argparse.Namespace(ranks_per_node=getattr(args, "ranks_per_node", None), world_size=args.world_size,
                              tensor_model_parallel_size=args.tensor_model_parallel_size, data_parallel_size=dp)
    try:
        rpn = dp_ranks_per_node(view)
    except ArgumentError as e:
        raise ValueError(str(e)) from None
    notice = getattr(view, "topology_notice", None)
    if notice and dist.get_rank() == 0:
        print(notice, flush=True)
    try:
        plan = sharding_plan_from_args(args, dp, rpn)
    except ArgumentError as e:
        raise ValueError(str(e)) from None
    kw = dict(sharding=plan,
              overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
              overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
              grad_reduce=getattr(args, "grad_reduce", "plain"), param_gather=getattr(args, "param_gather", "plain"),
              ranks_per_node=rpn,
              check_for_nan_in_grad=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)))
    if getattr(args, "ddp_bucket_size", None):
        kw["bucket_size"] = int(args.ddp_bucket_size)
    if getattr(args, "qgz_bits", None):
        kw["qgz_bits"] = int(args.qgz_bits)
    if getattr(args, "quant_group_size", None):
        kw["quant_group_size"] = int(args.quant_group_size)
    if getattr(args, "odo_progress_engine", None) is not None:
        kw["progress_engine"] = bool(args.odo_progress_engine)
    if getattr(args, "odo_speculative_step", False):
        kw["speculative_step"] = True
    kw.update(qgz_stages_config(args))
    return mx.OverlapConfig(**kw)


def _make_ddp_switch(original_ddp: type, get_args: Callable[[], Any]) -> type:
    """A stand-in for Megatron-LM's ``DDP`` name: builds an OverlappedDDP when the flag is on, else the original.

    ``isinstance(x, DDP)`` checks in Megatron-LM keep working for both kinds of wrapper (metaclass hook).
    """
    from megatron_ext.optimizer.overlapped_ddp import OverlappedDDP

    class _Meta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, (original_ddp, OverlappedDDP))

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, (original_ddp, OverlappedDDP))

    class DDP(metaclass=_Meta):  # noqa: D401 - mirrors Megatron-LM's name
        """Megatron-LM's DDP, or megatron_ext's OverlappedDDP under --use-overlapped-distributed-optimizer."""

        def __new__(cls, *args: Any, **kwargs: Any):
            margs = get_args()
            if not _enabled(margs):
                return original_ddp(*args, **kwargs)
            names = ("config", "ddp_config", "module")
            bound = dict(zip(names, args))
            bound.update({k: kwargs[k] for k in names if k in kwargs})
            if "module" not in bound:
                raise TypeError("DDP(...) called without a module")
            dp_group = kwargs.get("data_parallel_group")
            pg = kwargs.get("pg_collection")
            if dp_group is None and pg is not None:
                dp_group = getattr(pg, "dp_cp", None) or getattr(pg, "dp", None)
            if dp_group is None:
                from megatron.core import parallel_state as ps
                dp_group = ps.get_data_parallel_group(with_context_parallel=True)
            return OverlappedDDP(bound["module"], overlap_config_from_megatron_args(margs), dp_group=dp_group)

    DDP.original = original_ddp  # type: ignore[attr-defined]
    return DDP


def _make_get_optimizer(original: Callable, get_args: Callable[[], Any]) -> Callable:
    def get_megatron_optimizer(config, model_chunks, *args: Any, **kwargs: Any):
        """Megatron-LM's optimizer factory, or the ODO over the (OverlappedDDP) model chunks."""
        if not _enabled(get_args()):
            return original(config, model_chunks, *args, **kwargs)
        from .optimizer_state import MegatronLMOverlappedOptimizer

        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        return MegatronLMOverlappedOptimizer(config, chunks if len(chunks) > 1 else chunks[0],
                                             config_overrides=_config_overrides(original, config, model_chunks,
                                                                                args, kwargs))

    get_megatron_optimizer.original = original  # type: ignore[attr-defined]
    return get_megatron_optimizer


def _config_overrides(original: Callable, config: Any, model_chunks: Any, args: tuple, kwargs: dict) -> Any:
    """The ``config_overrides`` Megatron-LM passed (megatron-core's param groups), read by the original factory's
    signature; its arguments the ODO would not honour are refused by name."""
    import inspect

    try:
        bound = inspect.signature(original).bind(config, model_chunks, *args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = dict(kwargs)
    for name, fine in (("no_weight_decay_cond", None), ("scale_lr_cond", None), ("lr_mult", 1.0),
                       ("dump_param_to_param_group_map", None)):
        if bound.get(name, fine) != fine:
            raise ValueError(f"get_megatron_optimizer({name}=...) is not supported with --use-overlapped-"
                             "distributed-optimizer: give the param groups as config_overrides (megatron-core's "
                             "ParamKey -> ParamGroupOverride)")
    return bound.get("config_overrides")


def install(training_module: Any = None, get_args: Optional[Callable[[], Any]] = None,
            utils_module: Any = None, checkpointing_module: Any = None) -> None:
    """Patch ``megatron.training.training`` (a Megatron-LM checkout) so the flag builds the ODO. Idempotent.

    ``training_module``/``get_args``/``utils_module``/``checkpointing_module`` default to the checkout's; tests pass
    stand-ins.
    """
    if _ORIGINALS:
        return
    if training_module is None:
        try:
            training_module = importlib.import_module("megatron.training.training")
        except ImportError as e:
            raise ImportError("megatron_ext.megatron_lm.install() needs a Megatron-LM checkout on PYTHONPATH "
                              "(megatron.training is not part of the megatron-core pip package)") from e
    get_args = get_args or _megatron_args
    from megatron_ext.optimizer.overlapped_ddp import OverlappedDDP

    _ORIGINALS["module"] = training_module
    _ORIGINALS["DDP"] = training_module.DDP
    _ORIGINALS["get_megatron_optimizer"] = training_module.get_megatron_optimizer
    training_module.DDP = _make_ddp_switch(training_module.DDP, get_args)
    training_module.get_megatron_optimizer = _make_get_optimizer(training_module.get_megatron_optimizer, get_args)
    # unwrap_model(model, module_instances=None) builds its default wrapper list (megatron-core's DDP, FSDP,
    # Float16Module) inside megatron.core.utils, and the checkout imports it by name into several modules: every
    # binding of that function is replaced by one that peels OverlappedDDP first.
    original_unwrap = getattr(training_module, "unwrap_model", None)
    if original_unwrap is not None:
        holders = [m for m in [training_module, utils_module] + _loaded_megatron_modules()
                   if m is not None and getattr(m, "unwrap_model", None) is original_unwrap]
        unwrap = _make_unwrap(original_unwrap, OverlappedDDP)
        _ORIGINALS["unwrap"] = (original_unwrap, holders)
        for m in holders:
            m.unwrap_model = unwrap
    # torch_dist loads note their directory: Megatron's dp_reshardable optimizer state is read from it
    # (bucket_state.py)
    checkpointing = checkpointing_module or _optional_import("megatron.training.checkpointing")
    if checkpointing is not None:
        from .bucket_state import install_load_recorder

        original = install_load_recorder(checkpointing)
        if original is not None:
            _ORIGINALS["dist_checkpointing"] = (checkpointing, original)


def _make_unwrap(original: Callable, wrapper_cls: type) -> Callable:
    def unwrap_model(model, module_instances=None):
        """Megatron-LM's unwrap_model, which also removes the OverlappedDDP wrapper."""
        def peel(m):
            while isinstance(m, wrapper_cls):
                m = m.module
            return m
        model = [peel(m) for m in model] if isinstance(model, list) else peel(model)
        return original(model, module_instances)

    unwrap_model.original = original  # type: ignore[attr-defined]
    return unwrap_model


def _loaded_megatron_modules() -> list:
    import sys
    return [m for name, m in list(sys.modules.items()) if name.startswith("megatron.") and m is not None]


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    if not _ORIGINALS:
        return
    mod = _ORIGINALS["module"]
    mod.DDP = _ORIGINALS["DDP"]
    mod.get_megatron_optimizer = _ORIGINALS["get_megatron_optimizer"]
    if "unwrap" in _ORIGINALS:
        original, holders = _ORIGINALS["unwrap"]
        for m in holders:
            m.unwrap_model = original
    if "dist_checkpointing" in _ORIGINALS:
        from .bucket_state import uninstall_load_recorder

        uninstall_load_recorder(*_ORIGINALS["dist_checkpointing"])
    _ORIGINALS.clear()


def _optional_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
