"""Launching a Triton kernel through the binary Triton already compiled for its arguments.

Why: a JIT call (``kernel[grid](...)``) binds and specializes every argument and looks its binary up on each launch.
On an H100's host that is 19 us per launch against 6 us for the compiled kernel's own launcher, and a quantized
bucket launches two to five kernels on the training thread. Here the first launch of each argument signature goes
through the JIT call, which compiles or finds the binary and returns it; later launches with the same signature
call that binary's launcher directly.

The signature is finer than any specialization Triton makes: every int and bool by value, every float by its bits,
every tensor by dtype and 16-byte alignment (Triton specializes pointers on that alignment only), the constexprs and
options by value, and the current device. The JIT call is used instead whenever Triton's launch hooks, its
stages-inspection hook or the kernel's pre-run hooks are set (profilers and tools need them), for a callable grid or
an argument of another type, under the interpreter (``TRITON_INTERPRET=1``), for a Triton without the
compiled-kernel attributes used here, and when ``MX_TRITON_FAST_LAUNCH=0`` at import. What the fast path does not
re-read on every launch, unlike the JIT call: Triton's debug, instrumentation and fp-sanitizer knobs (set at start,
as they are meant to be, they apply; changed later, only to new signatures) and the check that the globals a kernel
read at compile time have not changed (these kernels read none).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

_MAX_SIGNATURES = 512   # per kernel; buckets repeat a handful of geometries, so the cache is cleared, not evicted
_ENABLED = os.environ.get("MX_TRITON_FAST_LAUNCH", "1") != "0"
_MISSING, _UNSUPPORTED = object(), object()


def _knobs():
    try:
        from triton import knobs
        return knobs.runtime
    except (ImportError, AttributeError):   # a Triton before knobs: no fast path
        return None


def _hook_set(hook: Any) -> bool:
    """Whether a launch hook would do anything (Triton >= 3.7 keeps a HookChain, empty by default)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


class _Unkeyed(Exception):
    """An argument of a type the signature does not cover: that launch goes through the JIT call."""


def _arg_key(a: Any) -> Any:
    """An int stands for itself (the usual argument, so it is tested first); a bool keeps its type (1 == True), a
    float is keyed by its bits (so that NaN matches itself and -0.0 differs from 0.0)."""
    t = type(a)
    if t is int:
        return a
    if isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    if t is bool or a is None:
        return (t, a)
    if t is float:
        return (t, a.hex())
    raise _Unkeyed(t.__name__)


class FastLauncher:
    """``launcher(grid, *args, **constexprs_and_options)`` launches ``jit_fn`` as ``jit_fn[grid](...)`` would.

    ``args`` are the kernel's leading parameters, positionally; the keyword arguments are its remaining parameters
    (the constexprs) followed by any compile options (``num_warps``, ``enable_fp_fusion``...)."""

    def __init__(self, jit_fn: Any) -> None:
        self.fn = jit_fn
        self._compiled: Dict[tuple, Any] = {}
        names = getattr(jit_fn, "arg_names", None)
        self._names: Optional[Sequence[str]] = list(names) if names is not None else None
        from triton.runtime.jit import JITFunction
        self._runtime = _knobs()   # Triton's runtime knobs (one object; its hooks are read at every launch)
        self._fast = (_ENABLED and isinstance(jit_fn, JITFunction) and self._names is not None
                      and self._runtime is not None)

    def __call__(self, grid: Tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        entry = key = None
        if self._fast and not callable(grid):
            runtime = self._runtime
            if not (_hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)
                    or getattr(runtime, "add_stages_inspection_hook", None) is not None or self.fn.pre_run_hooks):
                try:
                    key = (torch._C._cuda_getDevice(), tuple([_arg_key(a) for a in args]), tuple(kwargs.items()))
                    entry = self._compiled.get(key, _MISSING)
                except (_Unkeyed, TypeError):   # TypeError: an unhashable constexpr or option
                    pass
        if entry is not None and entry is not _MISSING and entry is not _UNSUPPORTED:
            ck, tail = entry
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            ck.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(key[0]), ck.function, ck.packed_metadata,
                   None, None, None, *args, *tail)
            return
        ck = self.fn[grid](*args, **kwargs)
        if entry is _MISSING:
            if len(self._compiled) >= _MAX_SIGNATURES:
                self._compiled.clear()
            self._compiled[key] = self._entry(ck, len(args), kwargs)

    def _entry(self, ck: Any, nargs: int, kwargs: Dict[str, Any]) -> Any:
        """(binary, the constexpr values in parameter order), or _UNSUPPORTED where this Triton's binary lacks the
        launcher attributes used above (the JIT call then serves that signature)."""
        if not all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")) or ck.function is None:
            return _UNSUPPORTED
        rest = self._names[nargs:]
        if any(name not in kwargs for name in rest):
            return _UNSUPPORTED   # a parameter left to its default: let the JIT call bind it
        return ck, tuple(kwargs[name] for name in rest)
