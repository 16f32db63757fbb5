"""The one dispatch point: which implementation (``torch``, ``compiled`` or ``triton``) runs an op on a given tensor.

Default: Triton for CUDA tensors when Triton imports; elsewhere the reference's math compiled by ``torch.compile``
(:mod:`.compiled`, same bits), or the eager torch reference when ``MX_KERNELS_COMPILE=0``. Override for a whole
process with ``MX_KERNELS=torch|compiled|triton`` or for a block of code with ``with use_backend("triton"): ...``
(tests use the latter to run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from typing import Iterator

BACKENDS = ("torch", "compiled", "triton")
_local = threading.local()


def _forced() -> str | None:
    name = getattr(_local, "backend", None) or os.environ.get("MX_KERNELS") or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r} (MX_KERNELS or use_backend)")
    return name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force ``name`` ("torch", "compiled" or "triton"; None = automatic) for kernel calls made in this thread."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    prev = getattr(_local, "backend", None)
    _local.backend = name
    try:
        yield
    finally:
        _local.backend = prev


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(device_type: str) -> str:
    """The backend that runs an op whose main input lives on ``device_type``."""
    forced = _forced()
    if forced is not None:
        return forced
    if device_type == "cuda" and triton_available():
        return "triton"
    return "torch" if os.environ.get("MX_KERNELS_COMPILE", "").strip() == "0" else "compiled"
