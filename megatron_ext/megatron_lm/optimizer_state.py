"""The ODO as Megatron-LM's legacy (``--ckpt-format torch``) checkpointing sees a distributed optimizer.

[Note: how Megatron-LM saves a distributed optimizer]
``save_checkpoint`` writes ``optimizer.state_dict()`` from DP rank 0 only (into ``model_optim_rng.pt`` of each
TP/PP rank) and, with ``--use-distributed-optimizer``, calls ``optimizer.save_parameter_state(path)`` on every
rank for the sharded part; loading calls ``load_state_dict`` with DP rank 0's dict on every rank, then
``load_parameter_state(path)``. The ODO's own ``state_dict()`` is rank-local (this rank's slices), so handed to
that flow unchanged every other DP rank's slices would be lost. Here ``state_dict()`` holds only what all DP ranks
share (param groups, loss scaler, step) and the parameter state goes through ``save_parameter_state`` in the
canonical per-parameter layout: DP rank 0 writes one file, any DP size, bucket size or backend loads it.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.optimizer.checkpoint import CANONICAL_FORMAT, write_canonical_optimizer_state
from megatron_ext.optimizer.distributed_optimizer import OverlappedDistributedOptimizer
from megatron_ext.optimizer.inner_optimizer import same_update_rule, update_rule

COMMON_FORMAT = "megatron_ext.odo/1-common"


class MegatronLMOverlappedOptimizer(OverlappedDistributedOptimizer):
    """The ODO with Megatron-LM's ``DistributedOptimizer`` checkpoint split (common dict + parameter state)."""

    is_stub_optimizer = False

    def state_dict(self) -> dict:
        """What every DP rank shares: identical on all of them, so DP rank 0's copy serves everyone.

        No collective: Megatron-LM calls this on DP rank 0 only."""
        steps = [int(s["step"]) for s in self.inner.state.values() if "step" in s]
        return {"format": COMMON_FORMAT, "optimizer": update_rule(self.inner), "step": max(steps, default=0),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups],
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("format") != COMMON_FORMAT:
            return super().load_state_dict(state_dict)
        if not same_update_rule(state_dict["optimizer"], self.inner):
            raise ValueError(f"checkpoint optimizer is {state_dict['optimizer']}, this run's is "
                             f"{update_rule(self.inner)} (--optimizer)")
        # Param groups and the loss scaler apply now; the parameter state arrives with load_parameter_state.
        self._common = state_dict
        self._load_groups_and_scaler(state_dict)

    def save_parameter_state(self, filename: str) -> None:
        """Collective over DP: the state in canonical layout, written by DP rank 0 (merged from per-rank files)."""
        write_canonical_optimizer_state(super().state_dict(), filename, self.dp_group)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        """Every rank reads its slices of the canonical file (memory-mapped: only those pages are read)."""
        state = torch.load(filename, map_location="cpu", mmap=True, weights_only=False)
        if state.get("format") != CANONICAL_FORMAT:
            raise ValueError(f"{filename} is not an overlapped-distributed-optimizer parameter state "
                             f"(format={state.get('format')!r})")
        common: Optional[dict] = getattr(self, "_common", None)
        if common is not None:  # this run's loaded common dict wins over the copy inside the file
            state = dict(state, param_groups=common["param_groups"], grad_scaler=common["grad_scaler"])
        super().load_state_dict(state)
