"""OverlappedDistributedOptimizer: fp32 master shards, inner optimizer, loss scaling, clipping, param publish.

Implements megatron-core's ``MegatronOptimizer`` surface (see ANCHORS.md) on top of one or more
:class:`OverlappedDDP` chunks. Each rank updates only the slices of parameters inside its shards
(PartitionedParameter); the updated values are cast into the ParameterBuffer and all-gathered per bucket inside
the sharding plan's optim group.

[Note: replicas]
With ``optim < DP`` every shard is held by ``DP / optim`` replicas that receive bit-identical gradients and so
make bit-identical updates. Sums over the DP group (grad norm, zero count) take each shard once: only replica 0
contributes. Checkpoints take each shard from replica 0 as well.

[Note: masters]
An fp32 model gathered losslessly (``plain``) needs no master copy: the master slices are views of the rank's
shard of the ParameterBuffer, updated in place. Otherwise (bf16/fp16, or ``qwz``, which overwrites the owner's
slice with decoded weights) each bucket shard has an fp32 master.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .checkpoint import CANONICAL_FORMAT, LOCAL_FORMAT, state_slice
from .dist_checkpoint import SHARDED_FORMATS, local_state, sharded_header, sharded_optimizer_state
from .grad_scaler import ConstantLossScaler, DynamicLossScaler
from .group_collectives import (DP_SCALAR, MP_SCALAR, agree_on_setup, all_reduce_, collective_device,
                                dataclass_fields, node_peers)
from .inner_optimizer import build_inner_optimizer, inner_step, same_update_rule, set_inner_step, update_rule
from .model_parallel import counts_towards_norm, model_parallel_group
from .overlapped_ddp import OverlappedDDP
from .param_groups import build_param_groups, describe_groups, group_key_of_params, match_saved_groups
from .speculative_step import SpeculativeStep


class StepAbortedOnAllRanks(RuntimeError):
    """Raised by every DP rank at the same point of ``step()``, after the all-reduce that told them all."""


@dataclasses.dataclass
class _Piece:
    """The slice ``[start, end)`` of a flattened parameter that this rank owns."""

    chunk: int
    name: str
    param: torch.nn.Parameter
    start: int
    end: int
    master: torch.nn.Parameter    # fp32 view into the chunk's master partition
    grad: torch.Tensor            # fp32 view into the chunk's PartitionedGradient
    counted: bool                 # contributes to the global grad norm
    primary: bool                 # held by replica 0 of its shard (counted once in DP-wide sums, saved)


def _check_config(config, chunks: Sequence[OverlappedDDP]) -> None:
    """What the optimizer checks locally, before any collective."""
    if config.fp16 and config.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    if getattr(config, "clip_grad", 0.0) is not None and config.clip_grad < 0:
        raise ValueError(f"clip_grad (--clip-grad) must be >= 0, got {config.clip_grad}")
    check_optimizer_config(config)
    if any(c.overlap_config.speculative_step for c in chunks):
        if config.fp16:
            raise ValueError("speculative_step (--odo-speculative-step) does not work with fp16 (--fp16): the "
                             "loss scaler's overflow check is global like the clipping norm; use bf16")
        if len(chunks) > 1:
            raise ValueError("speculative_step (--odo-speculative-step) supports one model chunk (no virtual "
                             "pipeline, --num-layers-per-virtual-pipeline-stage): the chunks' rounds would share "
                             "one gather group and one progress engine, whose order they do not agree on")


class OverlappedDistributedOptimizer:
    """``config``: megatron-core's OptimizerConfig. ``config_overrides``: megatron-core's per-parameter group
    overrides ({ParamKey: ParamGroupOverride}, as ``get_megatron_optimizer`` takes them; None: its standard ones,
    see param_groups.py)."""

    def __init__(self, config, model: Union[OverlappedDDP, Sequence[OverlappedDDP]],
                 config_overrides: Optional[dict] = None) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        for c in chunks:
            if not isinstance(c, OverlappedDDP):
                raise TypeError("OverlappedDistributedOptimizer needs model chunks wrapped in mx.OverlappedDDP, "
                                f"got {type(c).__name__}")
        _check_config(config, chunks)
        self._group_keys = group_key_of_params(config, chunks, config_overrides)
        names = {pid: (n if len(chunks) == 1 else f"{ci}.{n}") for ci, c in enumerate(chunks)
                 for pid, n in c.param_names.items()}
        # every DP rank must step with the same hyper-parameters and groups (group_collectives.agree_on_setup)
        agree_on_setup(dict(dataclass_fields(config), param_groups=describe_groups(names, self._group_keys)),
                       chunks[0].topology.group, "OverlappedDistributedOptimizer", "OptimizerConfig")
        self.config = config
        self.chunks = chunks
        self.dp_group = chunks[0].topology.group
        self.mp_group = model_parallel_group()
        # Scalars are computed on the gradients' device and reduced where each group can reduce them.
        self.grad_device = chunks[0].main_grad_partition.device
        self._dp_device = collective_device(self.dp_group, self.grad_device)
        self._mp_device = collective_device(self.mp_group, self.grad_device) if self.mp_group is not None else None
        self._mp_peers = node_peers(self.mp_group) if self.mp_group is not None else (0, 0)
        # PartitionedParameter: one fp32 master shard per bucket (a view of the ParameterBuffer where that is
        # exact, see [Note: masters]), the PartitionedGradient's layout.
        self.master_flat: List[torch.Tensor] = []
        self.master_shards: List[Dict[int, torch.Tensor]] = []
        self._aliased: List[bool] = []
        for c in chunks:
            aliased = c.param_backend.name == "plain"
            self._aliased.append(aliased)
            own = [b for b in c.buckets if not (aliased and b.dtype == torch.float32)]
            flat = torch.empty(sum(b.shard_numel for b in own), dtype=torch.float32,
                               device=c.main_grad_partition.device)
            shards, off = {}, 0
            for b in c.buckets:
                if b in own:
                    shards[b.index] = flat[off:off + b.shard_numel]
                    shards[b.index].copy_(c.param_buffer.shard_view(b, c.shard_rank))
                    off += b.shard_numel
                else:
                    shards[b.index] = c.param_buffer.shard_view(b, c.shard_rank)
            self.master_flat.append(flat)
            self.master_shards.append(shards)
            c.optimizer_memory = functools.partial(self._memory_report, len(self.master_flat) - 1)
        self.pieces: List[_Piece] = []
        for ci, c in enumerate(chunks):
            counted_replica = c.plan.replica_rank == 0
            for b in c.buckets:
                for pi, a, e, s in b.owned_pieces(c.shard_rank):
                    p = b.params[pi]
                    master = torch.nn.Parameter(self.master_shards[ci][b.index][s:s + (e - a)], requires_grad=True)
                    lo = b.partition_offset + s
                    grad = c.main_grad_partition[lo:lo + (e - a)]
                    master.grad = grad
                    name = c.param_name(p) if len(chunks) == 1 else f"{ci}.{c.param_name(p)}"
                    self.pieces.append(_Piece(ci, name, p, a, e, master, grad,
                                              counts_towards_norm(p) and counted_replica, counted_replica))
        self.inner = build_inner_optimizer(config, self._param_groups())
        # [Note: speculative step] (speculative_step.py): chunks whose buckets are stepped and gathered in backward.
        self.speculation = [SpeculativeStep(self, ci) for ci, c in enumerate(chunks)
                            if c.overlap_config.speculative_step]
        # Inner-optimizer parameters no piece covers (a rank owning only padding gets an empty one): stepped with
        # the rest after a committed round, as the whole step would.
        covered = {id(pc.master) for pc in self.pieces}
        self._uncovered = [p for g in self.inner.param_groups for p in g["params"] if id(p) not in covered]
        if config.fp16:
            if config.loss_scale:
                self.grad_scaler = ConstantLossScaler(config.loss_scale)
            else:
                self.grad_scaler = DynamicLossScaler(
                    initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                    growth_interval=int(config.loss_scale_window), hysteresis=config.hysteresis)
        else:
            self.grad_scaler = None
        self._last_norm: Optional[float] = None

    # -- construction helpers -----------------------------------------------------------------------
    def _param_groups(self) -> List[dict]:
        """megatron-core's groups from ``config_overrides`` (param_groups.py); same groups on all ranks."""
        out = build_param_groups(self.config, self._group_keys, self.pieces)
        if not any(g["params"] for g in out):
            # A rank may own only padding (tiny model, many ranks); torch refuses an empty optimizer.
            out[0]["params"] = [torch.nn.Parameter(torch.zeros(0, device=self.grad_device))]
            out[0]["params"][0].grad = torch.zeros(0, device=self.grad_device)
        return out

    # -- MegatronOptimizer surface ------------------------------------------------------------------
    @property
    def param_groups(self) -> List[dict]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The fp32 master pieces this rank optimizes (megatron-core: the parameters of the param groups)."""
        return [p for g in self.inner.param_groups for p in g["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """The gradient pieces the global norm counts (TP duplicates and shared copies once)."""
        return [pc.grad for pc in self.pieces if pc.counted]

    def get_grad_stats_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The model-parallel group the norm and zero count are reduced over after the DP group."""
        return self.mp_group

    def offload_to_cpu(self, *args, **kwargs) -> None:
        raise NotImplementedError("the OverlappedDistributedOptimizer does not offload its states to the CPU")

    def restore_from_cpu(self, *args, **kwargs) -> None:
        raise NotImplementedError("the OverlappedDistributedOptimizer does not offload its states to the CPU")

    @property
    def masters(self) -> List[torch.Tensor]:
        """Each chunk's fp32 master shards in PartitionedGradient layout (a copy, for inspection)."""
        return [torch.cat([shards[b.index].float() for b in c.buckets])
                for c, shards in zip(self.chunks, self.master_shards)]

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.tensor([1.0])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale.to(loss.device, loss.dtype if loss.is_floating_point() else None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def prepare_grads(self) -> bool:
        """Finish grad sync, unscale (fp16) and return whether any rank found inf/nan."""
        for c in self.chunks:
            c.finish_grad_sync()
        if self.grad_scaler is None:
            return False
        inv = 1.0 / self.grad_scaler.scale.item()
        flags = self._sync_failed_flag(2)  # [found_inf, grad sync failed]
        for c in self.chunks:
            c.main_grad_partition.mul_(inv)
            flags[0] = torch.maximum(flags[0], (~torch.isfinite(c.main_grad_partition)).any().double())
        flags = self._all_reduce(flags, dist.ReduceOp.MAX).tolist()
        self._raise_if_sync_failed(flags[1])
        found_inf = flags[0] > 0
        self.grad_scaler.update(found_inf)
        return found_inf

    def get_grad_norm(self) -> float:
        """Global L2 norm from the shards; its all-reduce also carries the grad-sync failure flag."""
        grads = [pc.grad for pc in self.pieces if pc.counted and pc.grad.numel() > 0]
        sq = self._sync_failed_flag(2)  # [sum of squares, grad sync failed]
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            sq[0] = torch.stack(norms).double().pow(2).sum()
        total, failed = self._all_reduce(sq, dist.ReduceOp.SUM).tolist()
        self._raise_if_sync_failed(failed)
        return math.sqrt(total)

    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = self.get_grad_norm()
        coeff = _clip_coeff(clip_grad, norm)
        if coeff is not None:
            for c in self.chunks:
                c.main_grad_partition.mul_(coeff)
        return norm

    def get_params_norm(self) -> float:
        """L2 norm of the fp32 master weights, each element once (as the grad norm counts it): Megatron-LM's
        ``calc_params_l2_norm`` over the main params, logged under --log-params-norm. Collective, like the grad norm."""
        masters = [pc.master for pc in self.pieces if pc.counted and pc.master.numel() > 0]
        sq = torch.zeros(1, dtype=torch.float64, device=self.grad_device)
        if masters:
            sq[0] = torch.stack(torch._foreach_norm(masters, 2.0)).double().pow(2).sum()
        return math.sqrt(self._all_reduce(sq, dist.ReduceOp.SUM).item())

    def count_zeros(self) -> int:
        """Zeros in the gradient, each element counted once, as the norm counts it (TP duplicates and
        pipeline-shared copies once, as megatron-core's ``count_zeros_fp32``)."""
        local = torch.zeros(1, dtype=torch.float64, device=self.grad_device)
        for pc in self.pieces:
            if pc.counted:
                local += (pc.grad == 0).sum()
        return int(self._all_reduce(local, dist.ReduceOp.SUM).item())

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        for s in self.speculation:   # called on its own: the usual step of every piece (see speculative_step.py)
            if s.open:
                s.close(commit=False, upto=s.agreed_length())
        for c, aliased in zip(self.chunks, self._aliased):
            if aliased:
                c.param_sync.wait_all()   # the masters are the ParameterBuffer shards a gather may still send
        self.inner.step()
        self._publish_masters()
        return True

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """``(success, grad_norm, num_zeros)``; ``(False, None, None)`` when the step is skipped on overflow."""
        try:
            if self.prepare_grads():
                return False, None, None
            grad_norm = self.get_grad_norm()
            if not math.isfinite(grad_norm) and any(c.overlap_config.check_for_nan_in_grad for c in self.chunks):
                # the norm is global, so every rank raises here; nothing was applied
                raise StepAbortedOnAllRanks(f"the gradient norm is {grad_norm} (--check-for-nan-in-loss-and-grad): a "
                                            "NaN or inf gradient on some rank; the step was not applied")
        except StepAbortedOnAllRanks:
            # every rank raises here together (global flag or norm): undo what was stepped in backward, everywhere
            self._abort_speculation("the step failed")
            raise
        coeff = _clip_coeff(self.config.clip_grad, grad_norm)
        rounds = [(s, s.agreed_length()) for s in self.speculation if s.open]
        commit = bool(rounds) and coeff is None and all(s.hyper_unchanged() for s, _ in rounds)
        if not commit:
            for s, upto in rounds:
                s.close(commit=False, upto=upto)
            if coeff is not None:
                for c in self.chunks:
                    c.main_grad_partition.mul_(coeff)
        num_zeros = self.count_zeros() if getattr(self.config, "log_num_zeros_in_grad", False) else None
        if commit:
            self._step_after_commit(rounds)   # first: the forward reads these first (another group: order is free)
            for s, upto in rounds:
                s.close(commit=True, upto=upto)
        else:
            self.step_with_ready_grads()
        for s in self.speculation:
            s.end_step()
        self._last_norm = grad_norm
        return True, grad_norm, num_zeros

    def step_pieces(self, pieces: Sequence[_Piece], extra: Sequence[torch.Tensor] = ()) -> None:
        """The inner optimizer's step on ``pieces`` (and the parameters ``extra``) alone (elementwise: each element
        as in the whole step)."""
        keep = {id(pc.master) for pc in pieces} | {id(p) for p in extra}
        groups = self.inner.param_groups
        sub = [dict(g, params=[p for p in g["params"] if id(p) in keep]) for g in groups]
        sub = [g for g in sub if g["params"]]
        if not sub:
            return
        self.inner.param_groups = sub
        try:
            self.inner.step()
        finally:
            self.inner.param_groups = groups

    def _step_after_commit(self, rounds) -> None:
        """With committed rounds: step every bucket beyond each round's agreed length (the ones reduced last, which
        the forward reads first), deferred buckets and chunks without a round, and gather them in forward order on
        the original group (see [Note: speculative step])."""
        taken = {s.ci: {b.index for b in s.buckets[:upto]} for s, upto in rounds}   # on the speculative group
        stepped = {s.ci: {b.index for b in s.buckets[:s.stepped]} for s, _ in rounds}
        rest = [[b for b in getattr(c.param_sync, "forward_order", c.buckets) if b.index not in taken.get(ci, ())]
                for ci, c in enumerate(self.chunks)]
        pieces = []
        for ci, (c, buckets) in enumerate(zip(self.chunks, rest)):
            mine = {b.index for b in buckets if b.index not in stepped.get(ci, ())}
            for b in buckets:
                c.param_sync.wait_bucket(b.index)
            pieces += [pc for pc in self.pieces
                       if pc.chunk == ci and c.param_sync.bucket_of_param[id(pc.param)] in mine]
        self.step_pieces(pieces, extra=self._uncovered)
        for ci, (c, buckets) in enumerate(zip(self.chunks, rest)):
            if buckets:
                self.copy_masters(ci, buckets)
                c.param_sync.launch_buckets(buckets)

    def all_ranks_max(self, value: int) -> int:
        """The largest ``value`` over the DP group (a scalar all-reduce on the original group)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.grad_device)
        c = self.chunks[0]
        all_reduce_(t, dist.ReduceOp.MAX, self.dp_group, c.ledger, DP_SCALAR, c.topology.peers(), self._dp_device)
        return int(t.item())

    def _abort_speculation(self, why: str) -> None:
        for s in self.speculation:
            s.abort(why)

    def force_param_sync(self) -> None:
        for c in self.chunks:
            c.force_param_sync()

    def _settle(self) -> None:
        """No gather in flight: ZeRO-2's weights are then current; ZeRO-3's shards are never touched by one."""
        self._abort_speculation("the optimizer state was read or loaded between a backward and its step")
        for c in self.chunks:
            c.param_sync.wait_all()

    @torch.no_grad()
    def reload_model_params(self, state_dict=None) -> None:
        """Copy the model's current weights into the fp32 masters (after loading model weights only)."""
        if state_dict is not None:
            raise NotImplementedError("reload_model_params(state_dict): load the weights into the model first "
                                      "(model.load_state_dict), then call reload_model_params() without arguments")
        # (a model load_state_dict inside the round rolled it back already, before the new weights came in)
        self._abort_speculation("reload_model_params() ran between a backward and its step")
        for ci, c in enumerate(self.chunks):
            c.param_sync.wait_all()
            for b in c.buckets:
                view = c.param_buffer.shard_view(b, c.shard_rank)
                master = self.master_shards[ci][b.index]
                if master.data_ptr() != view.data_ptr():
                    master.copy_(view)

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's pieces, keyed by parameter name, in the parameter's flattened coordinates."""
        self._settle()
        params: Dict[str, dict] = {}
        step = inner_step(self.inner)
        for pc in self.pieces:
            shape = self.chunks[pc.chunk].param_shape(pc.param)
            entry = {"shape": tuple(shape), "numel": shape.numel(), "start": pc.start, "end": pc.end,
                     "master": pc.master.detach().clone()}
            for k, v in self.inner.state.get(pc.master, {}).items():
                if torch.is_tensor(v) and v.numel() == pc.master.numel() and v.dim() > 0:
                    entry[k] = v.detach().clone()
            params[pc.name] = entry
        all_names = {c.param_name(p) if len(self.chunks) == 1 else f"{ci}.{c.param_name(p)}": (
            tuple(c.param_shape(p)), c.param_shape(p).numel()) for ci, c in enumerate(self.chunks) for b in c.buckets
            for p in b.params}
        step = int(self._all_reduce(torch.tensor([float(step)], dtype=torch.float64, device=self.grad_device),
                                    dist.ReduceOp.MAX).item())
        plan = self.chunks[0].plan
        return {"format": LOCAL_FORMAT, "dp_size": self.chunks[0].topology.size,
                "dp_rank": self.chunks[0].topology.rank, "plan": plan.describe(), "replica": plan.replica_rank,
                **self.shared_state(step), "all_params": all_names, "params": params}

    def shared_state(self, step: int) -> dict:
        """What every checkpoint layout records beside the per-element state, the same on every DP rank: the update
        rule, the step (``step``: as the caller agreed it), the param groups' hyper-parameters, the loss scaler."""
        return {"optimizer": update_rule(self.inner), "step": int(step),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups],
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def state_dict_problems(self, state_dict: dict) -> List[str]:
        """What :meth:`load_state_dict` would reject in ``state_dict`` for this rank's pieces, found without applying
        anything (no collective): another format or optimizer type, a parameter missing or of another size, a state
        tensor missing or of another size."""
        fmt = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
        if fmt not in (CANONICAL_FORMAT, LOCAL_FORMAT):
            return [f"not an overlapped-distributed-optimizer state dict (format {fmt!r}): saved by another optimizer, "
                    "e.g. Megatron-LM's own DistributedOptimizer? Load the model weights only (Megatron-LM: "
                    "--no-load-optim) and the ODO starts its state afresh from them"]
        if fmt == LOCAL_FORMAT and (state_dict["dp_size"] != self.chunks[0].topology.size
                                    or state_dict["dp_rank"] != self.chunks[0].topology.rank):
            return ["a rank-local optimizer state saved at DP size "
                    f"{state_dict['dp_size']} cannot be loaded at DP size {self.chunks[0].topology.size}: "
                    "merge the shards first (megatron_ext.optimizer.checkpoint.merge_optimizer_shards)"]
        ours = update_rule(self.inner)
        if not same_update_rule(state_dict.get("optimizer"), self.inner):
            return [f"the optimizer state is for {state_dict.get('optimizer')}, this optimizer is {ours} "
                    "(OptimizerConfig.optimizer, --optimizer); load the model weights only "
                    "(reload_model_params) to start it afresh"]
        keys = ["master"] + (optimizer_state_keys(self.inner) if has_optimizer_state(state_dict, self.inner) else [])
        problems = []
        for pc in self.pieces:
            entry = state_dict["params"].get(pc.name)
            numel = self.chunks[pc.chunk].param_shape(pc.param).numel()   # p.numel() is 0 under ZeRO-3
            if entry is not None and entry.get("numel") != numel:
                problems.append(f"{pc.name}: optimizer state for {entry.get('numel')} elements (shape "
                                f"{tuple(entry.get('shape', ()))}), this model has {numel}")
                continue
            for key in keys:
                try:
                    state_slice(state_dict, pc.name, key, pc.start, pc.end)
                except (KeyError, ValueError) as e:
                    problems.append(str(e).strip("'\""))
                    break
        return problems

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a canonical (any DP size, bucket size or backend) or this rank's own local state dict, or what
        ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict` (any DP or TP/PP size). Checked on
        every rank first (:meth:`state_dict_problems`); if any rank finds a problem, every rank raises ValueError
        before anything is loaded."""
        if isinstance(state_dict, dict) and state_dict.get("format") in SHARDED_FORMATS:
            state_dict = local_state(self, state_dict, sharded_header(state_dict))
        problems = self.state_dict_problems(state_dict)
        failed = self._all_reduce(torch.tensor([float(bool(problems))], dtype=torch.float64,
                                               device=self.grad_device), dist.ReduceOp.MAX)
        if failed.item() > 0:
            raise ValueError("the optimizer state does not fit this optimizer: " + "; ".join(problems)
                             if problems else "the optimizer state does not fit this optimizer on another rank "
                             "(nothing was loaded)")
        self._settle()
        step = state_dict.get("step", 0)
        # Saved before any step was applied (fp16's first steps are skipped while the loss scale falls): the inner
        # optimizer had no state yet, and gets none, as a fresh one.
        keys = optimizer_state_keys(self.inner) if has_optimizer_state(state_dict, self.inner) else []
        for pc in self.pieces:
            pc.master.copy_(state_slice(state_dict, pc.name, "master", pc.start, pc.end))
            st = {}
            for key in keys:
                st[key] = state_slice(state_dict, pc.name, key, pc.start, pc.end).to(pc.master.device).clone()
            if st:
                st["step"] = torch.tensor(float(step))
                self.inner.state[pc.master] = st
            else:
                self.inner.state.pop(pc.master, None)
        self._load_groups_and_scaler(state_dict)
        if keys:
            set_inner_step(self.inner, step)
        self._publish_masters()
        self._settle()

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core dist-checkpointing (``--ckpt-format torch_dist``): this rank's pieces as blocks of the model's
        own tensors, Megatron's ``fully_reshardable`` layout (see dist_checkpoint.py); ``load_state_dict`` takes what
        ``dist_checkpointing.load`` returns for it. Collective over DP."""
        return sharded_optimizer_state(self, model_sharded_state_dict, is_loading, metadata)

    # -- internals ----------------------------------------------------------------------------------
    def _load_groups_and_scaler(self, state_dict: dict) -> None:
        """Hyper-parameters of the param groups (lr, weight decay, ...) and the loss scaler's state."""
        saved_groups = state_dict.get("param_groups") or []
        for g, sg in zip(self.inner.param_groups, match_saved_groups(saved_groups, self.inner.param_groups)):
            if sg is not None:
                g.update({k: v for k, v in sg.items() if k in g and k not in ("params", "overrides")})
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _publish_masters(self) -> None:
        """Cast masters into the ParameterBuffer shards and all-gather every bucket."""
        for ci in range(len(self.chunks)):
            self.publish_chunk(ci)

    def publish_chunk(self, ci: int) -> None:
        """:meth:`_publish_masters` for chunk ``ci``."""
        c = self.chunks[ci]
        c.param_sync.wait_all()
        self.copy_masters(ci, c.buckets)
        c.param_sync.launch()

    def copy_masters(self, ci: int, buckets) -> None:
        """Cast chunk ``ci``'s masters of ``buckets`` into their ParameterBuffer shards (the gathers' sources)."""
        c = self.chunks[ci]
        for b in buckets:
            view = c.param_buffer.shard_view(b, c.shard_rank)
            master = self.master_shards[ci][b.index]
            if master.data_ptr() != view.data_ptr():
                view.copy_(master)

    def _memory_report(self, chunk: int) -> Dict[str, int]:
        """Bytes of master weights and optimizer states this rank holds for model chunk ``chunk`` (see
        optimizer/memory.py), so that the chunks' reports add up to the optimizer's."""
        states = 0
        for pc in self.pieces:
            if pc.chunk == chunk:
                st = self.inner.state.get(pc.master, {})
                states += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        flat = self.master_flat[chunk]
        return {"master_weights": flat.numel() * flat.element_size(), "optimizer_states": states}

    def _sync_failed_flag(self, n: int) -> torch.Tensor:
        """``n`` float64 zeros on the gradients' device; the last is 1 when this rank's grad sync failed."""
        t = torch.zeros(n, dtype=torch.float64, device=self.grad_device)
        if any(c.grad_sync.error for c in self.chunks):
            t[-1] = 1.0
        return t

    def _raise_if_sync_failed(self, failed: float) -> None:
        if failed > 0:
            local = [c.grad_sync.error for c in self.chunks if c.grad_sync.error]
            where = local[0] if local else "on another rank (see that rank's log)"
            raise StepAbortedOnAllRanks(f"gradient synchronisation failed in the last backward, step aborted on every "
                                        f"rank before any weight changed: {where}")

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        """Reduce a small tensor over the DP group, then the model-parallel group (devices and ledger handled)."""
        c = self.chunks[0]
        all_reduce_(t, op, self.dp_group, c.ledger, DP_SCALAR, c.topology.peers(), self._dp_device)
        if self.mp_group is not None:
            all_reduce_(t, op, self.mp_group, c.ledger, MP_SCALAR, self._mp_peers, self._mp_device)
        return t


def _clip_coeff(clip_grad: float, norm: float) -> Optional[float]:
    """The factor global clipping scales the gradients by, None when it leaves them (megatron-core's rule; a NaN
    norm is not clipped)."""
    if clip_grad and clip_grad > 0:
        coeff = clip_grad / (norm + 1.0e-6)
        if coeff < 1.0:
            return coeff
    return None


def check_optimizer_config(config) -> None:
    """OptimizerConfig options the ODO does not implement, refused by name instead of ignored (before any
    collective)."""
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr (--lr) must be set")
    if config.fp16 and config.loss_scale is not None and config.loss_scale <= 0:
        raise ValueError(f"OptimizerConfig.loss_scale (--loss-scale) must be positive, got {config.loss_scale}")
    for field, flag, default in (("optimizer_cpu_offload", "--optimizer-cpu-offload", False),
                                 ("overlap_param_gather_with_optimizer_step",
                                  "--overlap-param-gather-with-optimizer-step", False)):
        if getattr(config, field, default) not in (default, None):
            raise ValueError(f"OptimizerConfig.{field} ({flag}) is not supported by the "
                             "OverlappedDistributedOptimizer")


def has_optimizer_state(state_dict: dict, inner: torch.optim.Optimizer) -> bool:
    """Whether a saved state holds per-element optimizer state: not when it was saved before the first applied
    step (the inner optimizer creates its state then). Judged by the tensors themselves, since not every optimizer
    counts steps (SGD keeps no ``step``)."""
    keys = optimizer_state_keys(inner)
    return any(k in entry for entry in state_dict.get("params", {}).values() for k in keys)


def optimizer_state_keys(inner: torch.optim.Optimizer) -> List[str]:
    """Per-element state tensors a checkpoint holds for each parameter slice (besides the fp32 master)."""
    if isinstance(inner, torch.optim.SGD):
        return ["momentum_buffer"] if inner.defaults.get("momentum", 0) else []
    return ["exp_avg", "exp_avg_sq"]
