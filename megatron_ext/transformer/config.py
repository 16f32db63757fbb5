"""What kind of residual wiring a Ladder/Desync block uses; validated before any model is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LadderConfig:
    """``ladder_layers``: how many of the *upper* layers use Ladder Residual (None = all, 0 = none).
    ``desync``: None, "2x" or "4x" (seed 002 section 5; all layers, standard wiring, dropped reductions).
    ``backward_overlap``: overlap the gradient all-reduce of module k with module k+1's backward (ladder only).
    """

    ladder: bool = False
    ladder_layers: Optional[int] = None
    desync: Optional[str] = None
    backward_overlap: bool = True

    def __post_init__(self) -> None:
        if self.desync not in (None, "2x", "4x"):
            raise ValueError(f"--desync-residual must be 2x or 4x, got {self.desync!r}")
        if self.ladder and self.desync:
            raise ValueError("--ladder-residual and --desync-residual are separate architectures; pick one")
        if self.ladder_layers is not None and self.ladder_layers < 0:
            raise ValueError(f"--ladder-residual-layers must be >= 0, got {self.ladder_layers}")
        if self.ladder_layers is not None and not self.ladder:
            raise ValueError("--ladder-residual-layers needs --ladder-residual")

    def num_ladder_layers(self, num_layers: int) -> int:
        if not self.ladder:
            return 0
        n = num_layers if self.ladder_layers is None else self.ladder_layers
        if n > num_layers:
            raise ValueError(f"--ladder-residual-layers {n} exceeds --num-layers {num_layers}")
        return n

    def reduces(self, module_index: int) -> bool:
        """Desync-nx keeps only the last all-reduce of every n consecutive modules (attention, mlp, ...)."""
        if self.desync is None:
            return True
        n = int(self.desync[0])
        return (module_index + 1) % n == 0
