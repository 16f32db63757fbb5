"""Loss scalers with megatron-core's semantics (constant, and dynamic with hysteresis)."""
from __future__ import annotations

from typing import Any, Dict

import torch


class ConstantLossScaler:
    def __init__(self, scale: float) -> None:
        self._scale = torch.tensor([float(scale)])

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self._scale.item()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Nothing to restore: the scale is the one this run was given (``--loss-scale``), as megatron-core's
        constant scaler keeps it whatever the checkpoint's scaler was."""


class DynamicLossScaler:
    """Halve on overflow (after ``hysteresis`` overflows), double after ``growth_interval`` clean steps."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError("--initial-loss-scale and --min-loss-scale must be positive")
        self._scale = torch.tensor([float(initial_scale)])
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self._scale.item(), "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """The saved scale and trackers; a constant scaler's state (a run with ``--loss-scale``) gives its scale,
        from which the trackers start afresh."""
        self._scale = torch.tensor([float(sd["scale"])])
        self._growth_tracker = int(sd.get("growth_tracker", 0))
        self._hysteresis_tracker = int(sd.get("hysteresis_tracker", self.hysteresis))
