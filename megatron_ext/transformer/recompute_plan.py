"""Which layers of a Ladder/Desync block run as one (possibly checkpointed) segment: megatron's full-recompute
grouping, split where standard layers end and ladder/desync layers begin.

Kept apart from the block so the grouping can be tested as data: recomputation does not change the numbers, so a
wrong grouping (a checkpoint too many or too few) is only visible here.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional


class Segment(NamedTuple):
    """Layers ``start <= i < stop`` of this pipeline stage, run together."""

    start: int
    stop: int
    checkpointed: bool
    special: bool  # ladder/desync wiring (else megatron's standard layers)


def plan_segments(num_layers: int, first_special: int, recompute_granularity: Optional[str],
                  recompute_method: Optional[str], recompute_num_layers: Optional[int],
                  training: bool) -> List[Segment]:
    """Segments for ``num_layers`` layers whose indices ``>= first_special`` are ladder/desync layers.

    Follows megatron-core's ``TransformerBlock._checkpointed_forward`` (full granularity, training only):
    'uniform' checkpoints chunks of ``recompute_num_layers`` counted from layer 0 of the stage; 'block'
    checkpoints each of the first ``recompute_num_layers`` layers on its own and runs the rest plainly. A chunk
    that would straddle the standard -> ladder boundary is split there (a deviation from megatron, which has no
    such boundary): the two wirings hand different state between layers (ladder carries pending module outputs),
    so one checkpointed function cannot hold both.
    """
    if recompute_granularity == "full" and training:
        n = recompute_num_layers
        if recompute_method not in ("uniform", "block") or n is None or n < 1:
            raise ValueError("Invalid activation recompute method: recompute_granularity='full' needs "
                             f"recompute_method 'uniform' or 'block' and recompute_num_layers >= 1, got "
                             f"{recompute_method!r} / {n!r}")
        if recompute_method == "uniform":
            chunks = [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
        else:
            k = min(n, num_layers)
            chunks = [(i, i + 1, True) for i in range(k)] + [(k, num_layers, False)]
    else:
        chunks = [(0, num_layers, False)]
    segments: List[Segment] = []
    for start, stop, ckpt in chunks:
        for lo, hi, special in ((start, min(stop, first_special), False), (max(start, first_special), stop, True)):
            if lo < hi:
                segments.append(Segment(lo, hi, ckpt, special))
    return segments
