"""A quiet first screen: megatron-core's known fallback notices once, on rank 0; every other warning untouched.

megatron-core warns at import and at model build that Apex / Transformer Engine are missing and which fallback it
uses; every rank prints each of them, several times (about 40 lines before the first log line of a 4-rank CPU run).
Megatron-LM users expect one copy of such a notice, from rank 0. :func:`quiet_known_notices` shows each *known*
notice (:data:`KNOWN_NOTICES`) once, as a single line, on global rank 0 only, and hands any other warning to the
usual machinery on every rank: an unknown warning is never hidden.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Optional, Set

KNOWN_NOTICES = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    # megatron-core's advice for CUDA and for Transformer Engine, printed by every rank at every TP layer's backward
    # (tensor_parallel/layers.py) and at config time (transformer_config.py) whatever the device and implementation
    r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"If you are using transformer_engine as the transformer implementation, the core_attn",
)
_PATTERNS = [re.compile(p) for p in KNOWN_NOTICES]


def is_known_notice(text: str) -> bool:
    return any(p.match(text) for p in _PATTERNS)


def quiet_known_notices(rank: Optional[int] = None, stream=None) -> None:
    """Install the filter for this process (``rank``: the global rank, default torchrun's ``RANK``)."""
    rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
    original = warnings.showwarning
    if getattr(original, "_mx_notice_filter", False):
        return
    seen: Set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if is_known_notice(text):
            if rank == 0 and text not in seen:
                seen.add(text)
                print(f"> notice (megatron-core): {text}", file=stream or sys.stderr, flush=True)
            return
        original(message, category, filename, lineno, file, line)

    show._mx_notice_filter = True  # type: ignore[attr-defined]
    warnings.showwarning = show
