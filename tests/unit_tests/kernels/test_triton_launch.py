"""FastLauncher: which launches reuse a compiled binary and which go through the JIT call (a stand-in JIT function
and binary on CPU; the real kernels' outputs through it are compared with the torch path in triton_cases.py, on a GPU
when one is present)."""
import os
import types

import pytest
import torch

from megatron_ext.kernels import triton_launch


class _Binary:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Jit:
    """Stands in for a ``@triton.jit`` function of parameters (x, n, K, BLOCK)."""

    arg_names = ["x", "n", "K", "BLOCK"]

    def __init__(self):
        self.calls, self.binary, self.pre_run_hooks = [], _Binary(), []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.binary
        return call


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(triton_launch, "_knobs", lambda: hooks)
    jit = _Jit()
    fl = triton_launch.FastLauncher(jit)
    fl._fast = True   # the stand-in is not a JITFunction
    return fl, jit, hooks


def test_a_repeated_signature_runs_the_binary_with_the_constexprs_in_parameter_order(launcher):
    fl, jit, _ = launcher
    x = torch.zeros(64, dtype=torch.float32)
    fl((3,), x, 100, BLOCK=128, K=4, enable_fp_fusion=False)
    assert len(jit.calls) == 1 and not jit.binary.calls   # the first launch compiles through the JIT call
    fl((3, 2), x, 100, BLOCK=128, K=4, enable_fp_fusion=False)
    assert len(jit.calls) == 1
    assert jit.binary.calls == [(3, 2, 1, 1000, "function", "metadata", None, None, None, x, 100, 4, 128)]


@pytest.mark.parametrize("change", ["int", "int_type", "dtype", "alignment", "constexpr", "option", "device"])
def test_a_different_signature_goes_through_the_jit_call(launcher, monkeypatch, change):
    fl, jit, _ = launcher
    x = torch.zeros(64, dtype=torch.float32)
    args, kwargs = [x, 100], dict(K=4, BLOCK=128, enable_fp_fusion=False)
    fl((1,), *args, **kwargs)
    if change == "int":
        args[1] = 101
    elif change == "int_type":
        args[1] = 100.0
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.int32)
    elif change == "alignment":
        args[0] = x[1:]   # 4 bytes past a 16-byte boundary: Triton specializes pointers on that alignment
    elif change == "constexpr":
        kwargs["K"] = 2
    elif change == "option":
        kwargs["enable_fp_fusion"] = True
    else:
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    fl((1,), *args, **kwargs)
    assert len(jit.calls) == 2 and not jit.binary.calls
    fl((1,), *args, **kwargs)   # and that signature is then reused too
    assert len(jit.calls) == 2 and len(jit.binary.calls) == 1


def test_hooks_and_defaults_keep_the_jit_call(launcher):
    fl, jit, hooks = launcher
    x = torch.zeros(64, dtype=torch.float32)
    hooks.launch_enter_hook = types.SimpleNamespace(calls=[print])   # a profiler's hook must see every launch
    for _ in range(2):
        fl((1,), x, 1, K=1, BLOCK=1)
    hooks.launch_enter_hook = types.SimpleNamespace(calls=[])        # an empty hook chain (Triton >= 3.7)
    jit.pre_run_hooks.append(print)
    for _ in range(2):
        fl((1,), x, 1, K=1, BLOCK=1)
    jit.pre_run_hooks.clear()
    for _ in range(2):
        fl((1,), x, 1, K=1)   # BLOCK left to a default: only the JIT call binds it
    assert len(jit.calls) == 6 and not jit.binary.calls


@pytest.mark.parametrize("case", ["unkeyed_type", "unhashable_option", "callable_grid", "stages_hook"])
def test_what_the_signature_cannot_cover_keeps_the_jit_call(launcher, case):
    fl, jit, hooks = launcher
    x = torch.zeros(64, dtype=torch.float32)
    args, kwargs, grid = [x, 1], dict(K=1, BLOCK=1), (1,)
    if case == "unkeyed_type":
        args[1] = types.SimpleNamespace()
    elif case == "unhashable_option":
        kwargs["extern_libs"] = {"lib": "path"}
    elif case == "callable_grid":
        grid = lambda meta: (1,)   # noqa: E731 -- Triton's grid(meta) form
    else:
        hooks.add_stages_inspection_hook = print
    for _ in range(3):
        fl(grid, *args, **kwargs)
    assert len(jit.calls) == 3 and not jit.binary.calls


def test_floats_are_keyed_by_their_bits(launcher):
    fl, jit, _ = launcher
    x = torch.zeros(64, dtype=torch.float32)
    for v in (float("nan"), float("nan"), 0.0, -0.0, -0.0):
        fl((1,), x, v, K=1, BLOCK=1)
    # NaN reuses its binary (NaN != NaN as a value); -0.0 does not share 0.0's
    assert len(jit.calls) == 3 and len(jit.binary.calls) == 2


def test_the_real_kernels_take_the_fast_path_where_triton_compiles():
    """Outside the interpreter every launcher of triton_ops is armed (a Triton whose JITFunction lacks what the fast
    path needs would silently disarm it); on CPU nothing is launched here."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("MX_TRITON_FAST_LAUNCH") == "0":
        pytest.skip("the fast path is off by design here")
    pytest.importorskip("triton")
    from megatron_ext.kernels import triton_ops
    launchers = [v for v in vars(triton_ops).values() if isinstance(v, triton_launch.FastLauncher)]
    assert len(launchers) == 6 and all(fl._fast for fl in launchers)
