"""The ODO as Megatron-LM's checkpointing sees a distributed optimizer (``--ckpt-format torch`` and ``torch_dist``).

[Note: how Megatron-LM saves a distributed optimizer]
``save_checkpoint`` writes ``optimizer.state_dict()`` from DP rank 0 only (into ``model_optim_rng.pt`` of each
TP/PP rank) and, with ``--use-distributed-optimizer``, calls ``optimizer.save_parameter_state(path)`` on every
rank for the sharded part; loading calls ``load_state_dict`` with DP rank 0's dict on every rank, then
``load_parameter_state(path)``. The ODO's own ``state_dict()`` is rank-local (this rank's slices), so handed to
that flow unchanged every other DP rank's slices would be lost. Here ``state_dict()`` holds only what all DP ranks
share (param groups, loss scaler, step) and the parameter state goes through ``save_parameter_state`` in the
canonical per-parameter layout: DP rank 0 writes one file, any DP size, bucket size or backend loads it.

[Note: switching a Megatron-LM run to the ODO]
A checkpoint Megatron's own optimizers saved loads too, Adam state and LR schedule included, so a run switches to the
ODO without ``--no-load-optim``: the DistributedOptimizer's common dict waits for its ``distrib_optim.pt`` (read in
``load_parameter_state``, memory-mapped), the non-distributed optimizer's dict holds its state itself (its checkpoint
has no ``distrib_optim.pt``). Both are placed as the import tool places them (``checkpoint_import_optim.py``:
bucket walk, param-group order, proved against the weights Megatron-LM has just loaded), in the live model's own
registration order, and their param groups matched to the ODO's by megatron-core's override keys. A state that
cannot be placed fails every rank's load together, naming why.

[Note: torch_dist]
``save_checkpoint`` asks every rank for ``sharded_state_dict``: the ODO's model-space blocks under Megatron's
``fully_reshardable`` keys (``optimizer/dist_checkpoint.py``). Megatron's own optimizers save the same model-space
tensors (its non-distributed one, and its DistributedOptimizer in that layout), so their states load by key: only
their shared part (param groups, step, loss scaler) is read as the import reads it (``canonical_header``), and each
main weight is checked against its weight (megatron-core up to 0.19 writes ``fully_reshardable`` shifted after a
gradient buffer's first bucket). The DistributedOptimizer's default ``dp_reshardable`` layout (its buckets) is read
by each rank from the checkpoint directory itself, its own pieces only (``bucket_state.py``). The way back: the ODO's
checkpoint carries the shared part in the DistributedOptimizer's shape too (``dist_checkpoint.megatron_common``), so
Megatron-LM without the plug-in's flag resumes it with its Adam state.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron_ext.optimizer.checkpoint import CANONICAL_FORMAT, write_canonical_optimizer_state
from megatron_ext.optimizer.dist_checkpoint import SHARDED_FORMATS, local_state, sharded_optimizer_state, state_fields
from megatron_ext.optimizer.distributed_optimizer import OverlappedDistributedOptimizer
from megatron_ext.optimizer.inner_optimizer import inner_step, same_update_rule, update_rule
from megatron_ext.training.checkpoint_import_optim import (NON_DISTRIBUTED, SHIFTED_MODEL_SPACE, canonical_header,
                                                           is_main_of, torch_format_kind, torch_format_state)
from megatron_ext.training.checkpointing import CheckpointError

COMMON_FORMAT = "megatron_ext.odo/1-common"
DP_RESHARDABLE = "dp_reshardable"   # Megatron's default DistributedOptimizer layout in torch_dist (bucket_state.py)


class MegatronLMOverlappedOptimizer(OverlappedDistributedOptimizer):
    """The ODO with Megatron-LM's ``DistributedOptimizer`` checkpoint split (common dict + parameter state)."""

    is_stub_optimizer = False

    def state_dict(self) -> dict:
        """What every DP rank shares: identical on all of them, so DP rank 0's copy serves everyone.

        No collective: Megatron-LM calls this on DP rank 0 only."""
        return {"format": COMMON_FORMAT, **self.shared_state(inner_step(self.inner))}

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """``--ckpt-format torch_dist``: the ODO's model-space state (Megatron's ``fully_reshardable`` layout, see
        ``optimizer/dist_checkpoint.py``). Loading a checkpoint Megatron's non-distributed optimizer saved (its
        content metadata has no ``distrib_optim_sharding_type``), the same tensors are asked for under its names."""
        self._megatron_fields = None
        if is_loading and (metadata or {}).get("distrib_optim_sharding_type") == DP_RESHARDABLE:
            # Megatron's bucket layout: read in load_state_dict from the checkpoint itself (bucket_state.py); no
            # tensor is asked for here
            return {"param_state_sharding_type": DP_RESHARDABLE}
        if is_loading and _saved_by_non_distributed_optimizer(metadata):
            mixed = bool(self.config.bf16 or self.config.fp16)   # (an fp32 model's main weights are its weights)
            self._megatron_fields = [("master", "fp32_param")] * mixed + state_fields(self.inner)[1:]
        return sharded_optimizer_state(self, model_sharded_state_dict, is_loading, metadata, self._megatron_fields)

    def load_state_dict(self, state_dict: dict) -> None:
        if isinstance(state_dict, list) or (isinstance(state_dict, dict) and state_dict
                                            and all(isinstance(k, int) for k in state_dict)):
            # (the torch format saves a list; torch_dist a dict by optimizer index. The same on every rank: all raise)
            raise ValueError("Megatron's chained optimizers' state (--overlap-param-gather-with-optimizer-step, or "
                             "separate expert optimizers) is not read: Megatron-LM's --no-load-optim loads the "
                             "weights alone")
        self._megatron_common, self._megatron_loaded = None, False
        if state_dict.get("param_state_sharding_type") == DP_RESHARDABLE and "format" not in state_dict:
            return super().load_state_dict(self._agreed(self._read_bucket_state, "Megatron's dp_reshardable state"))
        if "param_state" in state_dict and state_dict.get("format") not in SHARDED_FORMATS:
            # torch_dist: Megatron's own optimizer saved the same model-space tensors (see sharded_state_dict)
            return super().load_state_dict(self._agreed(lambda: self._model_space_state(state_dict),
                                                        "Megatron's optimizer state (torch_dist)"))
        kind = torch_format_kind(state_dict)
        if kind == "distributed":   # its parameter state arrives with load_parameter_state
            self._megatron_common = state_dict
            return None
        if kind == NON_DISTRIBUTED:
            self._megatron_loaded = True
            return super().load_state_dict(self._from_megatron(state_dict, None))
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
        common = getattr(self, "_megatron_common", None)
        if common is not None:   # Megatron's DistributedOptimizer saved it (see the module note)
            self._megatron_common = None
            return super().load_state_dict(self._from_megatron(common, filename))
        if getattr(self, "_megatron_loaded", False):
            return None   # Megatron's non-distributed optimizer's state, loaded with its dict (no such file)
        state = torch.load(filename, map_location="cpu", mmap=True, weights_only=False)
        if state.get("format") != CANONICAL_FORMAT:
            raise ValueError(f"{filename} is not an overlapped-distributed-optimizer parameter state "
                             f"(format={state.get('format')!r})")
        common: Optional[dict] = getattr(self, "_common", None)
        if common is not None:  # this run's loaded common dict wins over the copy inside the file
            state = dict(state, param_groups=common["param_groups"], grad_scaler=common["grad_scaler"])
        super().load_state_dict(state)

    def _from_megatron(self, common: dict, param_state_path: Optional[str]) -> Dict[str, Any]:
        """Megatron's own optimizer state as the ODO's canonical one, placed against this rank's model (see the
        module note). Collective (DP, then model parallel): where any rank cannot place its state, every rank
        raises, before anything is loaded."""
        chunks, order, prefix = self._saved_names()
        where = param_state_path or "Megatron's optimizer state dict"

        def place() -> Dict[str, Any]:
            state, text = torch_format_state({"optimizer": common}, where, chunks, lambda key: key, True, prefix,
                                             self._group_args(), order=order, copy=False)
            if state is None:
                raise ValueError(text)
            return state
        return self._agreed(place, "Megatron's own optimizer state")

    def _model_space_state(self, loaded: dict) -> Dict[str, Any]:
        """This rank's pieces of Megatron's own model-space state (``loaded``, as ``dist_checkpointing.load`` filled
        :meth:`sharded_state_dict`'s request), each checked: its main weights, cast to the weight's dtype, are the
        weights Megatron-LM has just loaded (megatron-core's shifted fully_reshardable states are not)."""
        header = canonical_header(loaded, "Megatron's optimizer state (torch_dist)", args=self._group_args())
        fields = getattr(self, "_megatron_fields", None)
        state = local_state(self, loaded, header, fields)
        for pc in self.pieces:
            main = state["params"][pc.name]["master"]
            weight = pc.param.detach().reshape(-1)[pc.start:pc.end]
            if not is_main_of(main, weight):
                raise ValueError(f"{pc.name} (elements {pc.start}..{pc.end}): {SHIFTED_MODEL_SPACE}")
        return state

    def _read_bucket_state(self) -> Dict[str, Any]:
        """This rank's pieces of the ``dp_reshardable`` checkpoint Megatron-LM is loading (bucket_state.py)."""
        from megatron.core import parallel_state as ps

        from .bucket_state import last_loaded_dir, read_bucket_state

        ckpt = last_loaded_dir()
        if ckpt is None:
            raise ValueError("where the checkpoint lies is not known: the Megatron-LM plug-in's install() notes it "
                             "as Megatron-LM loads (its launch module and two-line form both install it)")
        return read_bucket_state(self, ckpt, torch.distributed.get_rank(ps.get_model_parallel_group()),
                                 self._group_args())

    def _group_args(self) -> Dict[str, Any]:
        """The run's flags that key megatron-core's param groups, which Megatron's saved groups are matched by."""
        return {k: getattr(self.config, k, None) for k in ("decoupled_lr", "decoupled_min_lr",
                                                            "apply_wd_to_qk_layernorm")}

    def _agreed(self, build: Callable[[], Dict[str, Any]], what: str) -> Dict[str, Any]:
        """``build()`` on every rank, agreed in one all-reduce before anything is loaded: where any rank failed,
        every rank raises, naming why where it knows."""
        try:
            state, text = build(), ""
        except (CheckpointError, ValueError) as e:
            state, text = None, str(e)
        except Exception as e:   # noqa: BLE001 - on this rank only, perhaps: every rank must reach the agreement
            state, text = None, f"{type(e).__name__}: {e}"
        failed = self._all_reduce(torch.tensor([float(state is None)], dtype=torch.float64, device=self.grad_device),
                                  torch.distributed.ReduceOp.MAX)
        if failed.item() > 0:
            raise ValueError(f"{what} does not fit this model: " + (
                text if state is None else "not on another rank (nothing was loaded)") + " (Megatron-LM: "
                "--no-load-optim loads the weights alone)")
        return state

    def _saved_names(self) -> Tuple[List[Dict[str, torch.Tensor]], List[Tuple[int, str]], str]:
        """Per chunk, its weights under the names Megatron-LM saves them (``Float16Module``'s ``module.`` left
        off, as ``state_dict_for_save_checkpoint``), their registration order, and the prefix left off."""
        named = [[(c.param_names[id(p)], p) for p in c.module.parameters() if id(p) in c.param_names]
                 for c in self.chunks]
        prefix = "module." if all(n.startswith("module.") for ps in named for n, _ in ps) else ""
        chunks = [{n[len(prefix):]: p.detach() for n, p in ps} for ps in named]
        return chunks, [(c, n[len(prefix):]) for c, ps in enumerate(named) for n, _ in ps], prefix


def _saved_by_non_distributed_optimizer(metadata: Optional[dict]) -> bool:
    """Whether Megatron-LM's content metadata of a torch_dist checkpoint says its optimizer was not distributed: it
    records ``distrib_optim_sharding_type`` for a distributed optimizer (the plug-in's too), and its other entries
    (``chained_optim_avoid_prefix``) either way."""
    return isinstance(metadata, dict) and "chained_optim_avoid_prefix" in metadata and \
        "distrib_optim_sharding_type" not in metadata
