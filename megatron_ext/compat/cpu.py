"""CPU shims for megatron-core; see the package docstring for the list and the reasons."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from .gloo_groups import patch_gloo_groups

_ENABLED = False

_SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Maps ``device="cuda"`` to CPU in any torch call and makes ``Tensor.cuda()`` / ``.to("cuda")`` identities."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        kwargs.pop("pin_memory", None)  # pinning needs an accelerator
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Run a block with ``device="cuda"`` mapped to CPU; a plain pass-through when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    with CudaToCpuMode():
        yield


def causal_attention_mask(seq_len: int, device: Any = "cpu") -> torch.Tensor:
    """megatron-core's mask convention: ``[1, 1, s, s]`` bool, True where attention is *masked* (future tokens)."""
    return torch.triu(torch.ones(seq_len, seq_len, device=device), diagonal=1).bool().view(1, 1, seq_len, seq_len)


def cpu_compat_enabled() -> bool:
    return _ENABLED


def enable_cpu_compat() -> bool:
    """Install the CPU shims (idempotent). Returns True if they are active, False when CUDA is available."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda()
    _patch_rng()
    _patch_masks()
    _patch_schedules()
    patch_gloo_groups()
    _ENABLED = True
    return True


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


# ---- RNG tracker on CPU generator states ---------------------------------------------------------------------


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    mp_random.CudaRNGStatesTracker.add = add
    mp_random.CudaRNGStatesTracker.fork = fork


# ---- masks ------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


@functools.lru_cache(maxsize=32)
def _sliding_window_causal_mask(sq: int, skv: int, window_size: tuple) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def _patch_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = _default_causal_mask
        mod.get_sliding_window_causal_mask = _sliding_window_causal_mask


# ---- schedules ------------------------------------------------------------------------------------------------


def _patch_schedules() -> None:
    from megatron.core.pipeline_parallel import schedules

    for name in _SCHEDULES:
        fn = getattr(schedules, name, None)
        if fn is None or getattr(fn, "_mx_cpu_wrapped", False):
            continue
        setattr(schedules, name, _under_cpu_mode(fn))


def _under_cpu_mode(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with cpu_device_mode():
            return fn(*args, **kwargs)

    wrapped._mx_cpu_wrapped = True  # type: ignore[attr-defined]
    return wrapped
