"""Every name the plug-in patches or calls in a Megatron-LM checkout, with the parameters it relies on.

One list serves two checks: against a real checkout (``tests/unit_tests/megatron_lm/test_checkout.py``, run when
``MEGATRON_LM_PATH`` names one) and against the stand-ins of the unit tests, so neither can drift from the call
sequence of Megatron-LM ``core_v0.16.1`` (the release matching the pinned megatron-core).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Requirement:
    module: str
    name: str
    params: Tuple[str, ...] = ()     # parameters the plug-in passes or that the checkout passes to our stand-ins
    kind: str = "callable"           # "callable" (function or class: its constructor) or "module"
    why: str = ""


CONTRACT: Tuple[Requirement, ...] = (
    Requirement("megatron.training.training", "DDP", ("config", "ddp_config", "module"),
                why="rebound by install(); get_model builds each chunk's wrapper through this module-global name"),
    Requirement("megatron.training.training", "get_megatron_optimizer", ("config", "model_chunks"),
                why="rebound by install(); setup_model_and_optimizer calls it"),
    Requirement("megatron.training.training", "pretrain", ("extra_args_provider",),
                why="the launch module chains our extra_args_provider into it"),
    Requirement("megatron.training", "pretrain", ("extra_args_provider",),
                why="pretrain_gpt.py imports pretrain from the package"),
    Requirement("megatron.training", "get_args", why="the switches read the parsed flags"),
    Requirement("megatron.training.arguments", "parse_args", ("extra_args_provider", "ignore_unknown_args"),
                why="our flags are checked inside the parser it builds"),
    Requirement("megatron.core.utils", "unwrap_model", ("model", "module_instances"),
                why="install() makes it unwrap OverlappedDDP (its default wrapper list is built inside it)"),
    Requirement("megatron.training.training", "unwrap_model", ("model", "module_instances"),
                why="imported by name: rebound too"),
    Requirement("megatron.training.checkpointing", "unwrap_model", ("model", "module_instances"),
                why="imported by name: rebound too (save/load unwrap the chunks)"),
    Requirement("megatron.training.checkpointing", "dist_checkpointing", kind="module",
                why="install() wraps it so that its load notes the torch_dist directory (Megatron's dp_reshardable "
                    "optimizer state is read from there: bucket_state.py)"),
    Requirement("megatron.core.dist_checkpointing", "load", ("sharded_state_dict", "checkpoint_dir"),
                why="the wrapper passes its arguments on, the directory second"),
)


def check(resolve: Optional[Callable[[str], object]] = None) -> List[str]:
    """Problems with :data:`CONTRACT` in the modules ``resolve(name)`` returns (default: importlib)."""
    resolve = resolve or importlib.import_module
    problems = []
    for req in CONTRACT:
        try:
            mod = resolve(req.module)
        except Exception as e:  # noqa: BLE001 - any import failure is a finding
            problems.append(f"{req.module}: cannot import ({type(e).__name__}: {e})")
            continue
        obj = getattr(mod, req.name, None)
        if obj is None:
            problems.append(f"{req.module}.{req.name} is missing ({req.why})")
            continue
        if req.kind == "module":
            if not inspect.ismodule(obj) and not hasattr(obj, "wrapped"):   # (install()'s wrapper passes too)
                problems.append(f"{req.module}.{req.name} is not a module ({req.why})")
            continue
        if not callable(obj):
            problems.append(f"{req.module}.{req.name} is not callable")
            continue
        try:
            sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
        except (TypeError, ValueError):
            continue
        names = set(sig.parameters)
        varkw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        missing = [p for p in req.params if p not in names and not varkw]
        if missing:
            problems.append(f"{req.module}.{req.name}{sig} lacks parameter(s) {missing} ({req.why})")
    return problems
