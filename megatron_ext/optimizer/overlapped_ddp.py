"""OverlappedDDP: the model wrapper. Owns the ParameterBuffer, the buckets and both collective paths.

Its public methods are the ones megatron-core's training loop, schedules and ``finalize_model_grads`` call on a
DDP-wrapped model chunk, so the loop needs no special case. It deliberately has no ``config`` attribute:
megatron-core's ``get_model_config`` looks through ``.module`` for the TransformerConfig.
"""
from __future__ import annotations

import contextlib
import math
import types
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from ..comm.backend import available_grad_reduce, available_param_gather, build_param_gather
from ..comm.ledger import CommLedger
from ..comm.plain import all_gather_recorded
from ..comm.progress import engine_for
from ..comm.topology import Topology
from .bucketing import Bucket, assign_buckets
from .config import OverlapConfig
from .grad_sync import GradSync
from .group_collectives import agree_on_setup, dataclass_fields, group_device_types
from .megatron_config import check_supported, per_token_loss
from .model_parallel import model_parallel_grad_reductions
from .memory import measured_model_state_bytes
from .param_buffer import ParameterBuffer
from .param_schedule import ShardedParamSync
from .param_sync import ParamSync
from .sharded_params import ShardedParameterStore
from .plan_comm import build_plan_comm, sums_only_reduction


class OverlappedDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, config: Optional[OverlapConfig] = None,
                 dp_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        config = config if config is not None else OverlapConfig()
        _check_member(dp_group)   # (no peer can wait for this rank: it is in none of the group's collectives)
        # Everything that can be checked locally is checked before the first collective; then the ranks agree on
        # the config in one all-reduce (group_collectives.agree_on_setup).
        named, device = self._check_locally(module, config, dp_group)
        agree_on_setup(dataclass_fields(config), dp_group, "OverlappedDDP", "OverlapConfig")
        self.topology.create_subgroups()
        self.ledger = CommLedger()
        # One progress engine per process and DP group (shared by the wrappers of one group, e.g. model chunks).
        self.engine = None
        if config.progress_engine and self.topology.size > 1:
            key = (id(dist.group.WORLD), tuple(self.topology.global_ranks), self.topology.ranks_per_node)
            self.engine = engine_for(key, device, dist.get_backend(self.topology.group))
            self.ledger.sync = self.engine.quiesce
        self.comm = build_plan_comm(self.plan, self.topology, config.grad_reduce, config.param_gather, self.ledger,
                                    config.backend_options(), engine=self.engine)
        self.grad_backend = self.comm.grad_reduce
        self.param_backend = self.comm.param_gather
        # The weight gathers a speculative step issues in backward, on a clone of the optim group of their own
        # (see [Note: speculative step] in speculative_step.py); the optimizer attaches its SpeculativeStep.
        self.speculative_gather = (build_param_gather(config.param_gather, self.comm.optim.engine_clone("speculative"),
                                                      self.ledger, config.backend_options())
                                   if config.speculative_step else None)
        self.speculation = None
        alignment = _lcm(config.shard_alignment, self.comm.shard_alignment)
        mp = model_parallel_grad_reductions(module)
        params = [p for _, p in named]
        self.param_names = {id(p): n for n, p in named}
        self._param_shapes = {id(p): p.shape for _, p in named}
        self.shard_rank = self.plan.shard_rank   # this rank's shard of every bucket (its rank in the optim group)
        self.buckets: List[Bucket] = assign_buckets(params, config.bucket_size, self.plan.optim, alignment,
                                                    deferred=[id(p) in mp for p in params])
        self.qgz_stages = config.resolved_qgz_stages(sum(not b.deferred for b in self.buckets),
                                                     self.engine is not None)
        if self.qgz_stages != config.backend_options().qgz_pipeline_stages:
            self.comm.set_qgz_stages(self.qgz_stages)
        _check_same_model_on_every_rank(named, self.frozen_params, self.buckets, self.topology.group, device)
        for _, p in named:
            p._megatron_ext_wrapped = True   # a second wrapper would steal this one's gradients
        self.param_buffer = ParameterBuffer(self.buckets, device)
        self.buffer_pool_size = config.resolved_buffer_pool_size(
            device, sums_only_reduction(self.plan, config.grad_reduce))
        self.partition_numel = sum(b.shard_numel for b in self.buckets)
        # PartitionedGradient: this rank's fp32 shard of every bucket, packed.
        self.main_grad_partition = torch.zeros(self.partition_numel, dtype=torch.float32, device=device)
        self.broadcast_params()
        self.grad_sync = GradSync(self.buckets, self.param_buffer, self.main_grad_partition, self.grad_backend,
                                  plan=self.plan, replica_backend=self.comm.replica_reduce,
                                  pool_size=self.buffer_pool_size,
                                  grad_reduce_in_fp32=config.grad_reduce_in_fp32,
                                  overlap=config.overlap_grad_reduce, mp_reductions=mp, ledger=self.ledger,
                                  post_reduce_scale=self.topology.size if per_token_loss(module) else 1.0,
                                  param_name=lambda p: repr(self.param_names.get(id(p), "?")))
        if self.plan.param > 1:
            # ZeRO-3: the full buffer above only lived to broadcast rank 0's weights; keep this rank's shards.
            self.param_buffer = ShardedParameterStore(self.param_buffer, self.buckets, self.shard_rank,
                                                      self.plan.hpz, self.plan.hpz_rank, config.gather_pool_size)
            self.grad_sync.param_buffer = self.param_buffer
            secondary = None
            if self.comm.hpz is not None:
                hpz_topo = self.comm.hpz
                secondary = lambda piece, out: all_gather_recorded(hpz_topo, self.ledger, piece, out,  # noqa: E731
                                                                   "hpz_all_gather")
            self.param_sync = ShardedParamSync(module, self.buckets, self.param_buffer, self.param_backend,
                                               secondary, overlap=config.overlap_param_gather)
            self.grad_sync.on_bucket_complete = self.param_sync.on_bucket_grads_complete
            self.grad_sync.on_backward_end = self.param_sync.on_backward_end
        else:
            self.param_sync = ParamSync(module, self.buckets, self.param_buffer, self.param_backend,
                                        self.shard_rank, overlap=config.overlap_param_gather)
        self.optimizer_memory = None   # set by the optimizer: a callable giving its bytes per component
        # Read by megatron-core's finalize_model_grads and training loop.
        self.ddp_config = types.SimpleNamespace(
            use_megatron_fsdp=False, use_custom_fsdp=False, use_distributed_optimizer=True,
            overlap_grad_reduce=config.overlap_grad_reduce, overlap_param_gather=config.overlap_param_gather,
            bucket_size=config.bucket_size, grad_reduce_in_fp32=config.grad_reduce_in_fp32,
            average_in_collective=False, check_for_nan_in_grad=config.check_for_nan_in_grad,
            num_distributed_optimizer_instances=1)   # megatron-core's own instances: ours are in self.plan


    def _check_locally(self, module: torch.nn.Module, config: OverlapConfig, dp_group):
        """The checks that need no collective: config, parameters, devices, the plan's rules (group creation is a
        collective, so the topology's subgroups wait). Sets the topology and plan; returns the trainable
        parameters and their device."""
        if not isinstance(config, OverlapConfig):
            raise TypeError(f"config must be a megatron_ext.OverlapConfig, got {type(config).__name__}")
        if config.grad_reduce not in available_grad_reduce():
            raise ValueError(f"grad_reduce (--grad-reduce) must be one of {available_grad_reduce()}, "
                             f"got {config.grad_reduce!r}")
        if config.param_gather not in available_param_gather():
            raise ValueError(f"param_gather (--param-gather) must be one of {available_param_gather()}, "
                             f"got {config.param_gather!r}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("OverlappedDDP: the module has no trainable parameters")
        # Frozen parameters (requires_grad=False) stay whole on every rank, outside the buckets, under every plan:
        # broadcast from DP rank 0 like the rest, checked alike, and reported as memory of their own.
        self.frozen_params = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        devices = {p.device for _, p in named + self.frozen_params}
        if len(devices) != 1:
            raise ValueError(f"OverlappedDDP: all parameters must be on one device, found {sorted(map(str, devices))}")
        device = next(iter(devices))
        _check_group_serves(dp_group, device)
        check_supported(module)
        _check_parameters(named, config)
        self.module = module
        self.overlap_config = config
        self.topology = Topology(dp_group, config.ranks_per_node, create_subgroups=False)
        self.plan = config.sharding.resolve(self.topology.size, self.topology.ranks_per_node, self.topology.rank)
        if config.speculative_step:
            _check_speculative_step(config, self.plan.param, device, per_token_loss(module))
        return named, device
    def offload_grad_buffers(self, *args, **kwargs) -> None:
        raise NotImplementedError("OverlappedDDP keeps no full gradient buffer to offload (gradients live in bucket "
                                  "buffers only while they are reduced, and in this rank's shard)")

    def restore_grad_buffers(self, *args, **kwargs) -> None:
        raise NotImplementedError("OverlappedDDP keeps no full gradient buffer to offload or restore")

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():   # where the backward starts, see [Note: the backward's end] in grad_sync.py
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._backward_reached_output)
        return out

    def _backward_reached_output(self, grad: torch.Tensor) -> None:
        self.grad_sync.backward_reached_output()

    # -- megatron-core DDP surface ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside accumulate gradients; communication follows the accumulation policy."""
        prev = self.grad_sync.sync_enabled
        self.grad_sync.sync_enabled = False
        try:
            yield
        finally:
            self.grad_sync.sync_enabled = prev

    def start_grad_sync(self, *unused) -> None:
        self.grad_sync.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Wait until this rank's PartitionedGradient holds the DP-averaged, accumulated gradient."""
        self.grad_sync.finish_grad_sync()

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        if force_sync:
            self.param_sync.wait_all()
        # Gathers are launched by the optimizer right after its step; nothing else is ever stale.

    def zero_grad_buffer(self) -> None:
        if self.speculation is not None:
            self.speculation.abort("the gradients were zeroed before the step")
            self.speculation.end_step()   # zeroed: a new step begins
        self.grad_sync.zero_grad()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Scale this rank's reduced gradient shard. With ``calculate_per_token_loss`` the shard holds the sum over
        DP (megatron-core's contract, see megatron_config.py) and ``finalize_model_grads`` passes 1 / global tokens."""
        if self.speculation is not None and scaling_factor != 1.0:
            self.speculation.abort("the gradients were scaled after the backward (scale_gradients)")
        self.main_grad_partition.mul_(scaling_factor)

    def enable_forward_pre_hook(self) -> None:
        if self.overlap_config.overlap_param_gather:
            self.param_sync.enable_hooks()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.param_sync.disable_hooks()
        if param_sync:
            self.param_sync.wait_all()

    def broadcast_params(self) -> None:
        """Make every DP rank start from DP rank 0's weights, frozen ones included (as megatron-core's DDP: a
        frozen layer that differs across ranks would train a different model on each)."""
        if self.topology.size == 1:
            return
        src = self.topology.global_rank(0)
        intra, inter = self.topology.peers()
        frozen = [p.data for _, p in self.frozen_params]
        for t in [*self.param_buffer.flat.values(), *frozen]:
            # Counted as a tree broadcast from rank 0: each byte reaches each peer once.
            if self.topology.rank == 0:
                self.ledger.record_pairwise("broadcast", t.numel() * t.element_size(), intra, inter)
            if t.is_contiguous():
                dist.broadcast(t, src=src, group=self.topology.group)
            else:
                dense = t.contiguous()
                dist.broadcast(dense, src=src, group=self.topology.group)
                t.copy_(dense)

    # -- helpers ------------------------------------------------------------------------------------
    def drop_gathered_weights(self) -> None:
        """ZeRO-3: release every gathered bucket now (after a save gathered them all); no-op otherwise."""
        self.param_sync.release_all()

    def force_param_sync(self) -> None:
        """Every weight readable now (ZeRO-3: gathered, until the next forward or step releases it)."""
        self.param_sync.gather_all()

    def state_dict(self, *args, **kwargs):
        """Collective under ZeRO-3 (the weights are gathered on every rank): call it on every DP rank."""
        self.param_sync.gather_all()
        sd = self.module.state_dict(*args, **kwargs)
        if self.plan.param > 1:   # the gathered buffers go back to the pool: hand out copies
            sd = type(sd)((k, v.clone() if torch.is_tensor(v) else v) for k, v in sd.items())
            self.param_sync.release_all()
        return sd

    def load_state_dict(self, state_dict, strict: bool = True):
        self.param_sync.gather_all()   # ZeRO-3: the module's load hooks then write the primary shards back
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, *args, **kwargs):
        self.param_sync.wait_all()
        return self.module.sharded_state_dict(*args, **kwargs)

    def buffer_stats(self) -> dict:
        """Live and peak bucket buffers of the gradient pool (buffer alternation)."""
        return {"live": self.grad_sync.live_buffers(), "peak": self.grad_sync.peak_live_buffers(),
                "pool_size": self.buffer_pool_size * max(1, len(self.grad_sync.pools)),
                "overflows": sum(p.overflows for p in self.grad_sync.pools.values())}

    def param_name(self, p: torch.nn.Parameter) -> str:
        return self.param_names[id(p)]

    def param_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """The parameter's shape, recorded when wrapped."""
        return self._param_shapes[id(p)]

    def memory_report(self) -> dict:
        """Bytes this rank holds per model-state component, measured from the tensors themselves (parameters,
        gradients, bucket pool; optimizer states and master weights once an optimizer is attached)."""
        report = measured_model_state_bytes(self)
        if self.optimizer_memory is not None:
            report.update(self.optimizer_memory())
        return report


def _check_parameters(named, config: OverlapConfig) -> None:
    """Local checks of the parameters themselves, before any collective."""
    for n, p in named:
        if getattr(p, "_megatron_ext_wrapped", False):
            raise ValueError(f"OverlappedDDP: parameter {n!r} is already wrapped by another OverlappedDDP (its "
                             "gradient hooks would take this wrapper's gradients): wrap each module once")
        if getattr(p, "allreduce", True) is False:
            raise ValueError(f"OverlappedDDP: parameter {n!r} is expert-parallel (allreduce=False, megatron-core "
                             "mixture-of-experts, --num-experts): the ODO reduces over the dense data-parallel "
                             "group only and does not support expert parallelism")
    quantized = [f"{flag} {name}" for flag, name in (("--grad-reduce", config.grad_reduce),
                                                      ("--param-gather", config.param_gather)) if name != "plain"]
    odd = sorted({str(p.dtype) for _, p in named if p.dtype not in (torch.float32, torch.float16, torch.bfloat16)})
    if quantized and odd:
        raise ValueError(f"{' and '.join(quantized)}: the quantized backends take float32, float16 or bfloat16 "
                         f"parameters, got {', '.join(odd)}")


def _check_member(dp_group: Optional[dist.ProcessGroup]) -> None:
    if dp_group is not None and dist.is_initialized() and dist.get_rank(dp_group) < 0:
        raise ValueError(f"OverlappedDDP: dp_group does not contain this rank (global rank {dist.get_rank()}; the "
                         f"group's ranks: {dist.get_process_group_ranks(dp_group)}): pass the data-parallel group "
                         "this rank belongs to")


def _check_same_model_on_every_rank(named, frozen, buckets, group, device: torch.device) -> None:
    """Every DP rank must wrap the same parameters (names, shapes, dtypes; the frozen ones too, which are broadcast)
    into the same buckets, or the collectives would pair the wrong elements silently (torch DDP checks its shapes
    alike). One all-reduce; on a mismatch every rank raises, naming what differs from rank 0's."""
    import zlib

    desc = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named]
    desc += [f"frozen {n}:{tuple(p.shape)}:{p.dtype}" for n, p in frozen]
    desc += [f"bucket{b.index}:{b.numel}:{b.shard_numel}" for b in buckets]
    h = float(zlib.crc32("\n".join(desc).encode()))
    t = torch.tensor([h, -h], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t[0].item() == -t[1].item():
        return
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, desc, group=group)
    first = everyone[0]
    for r, other in enumerate(everyone):
        diff = next((f"{a!r} on rank 0, {b!r} on DP rank {r}" for a, b in zip(first, other) if a != b), None)
        if diff is None and len(other) != len(first):
            diff = f"{len(first)} entries on rank 0, {len(other)} on DP rank {r}"
        if diff:
            raise ValueError(f"OverlappedDDP: the data-parallel ranks wrap different models ({diff}): every DP "
                             "rank must build the same model")


def _check_group_serves(dp_group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Bucket collectives run on the parameters' device: the DP group's backend must serve it (no collective)."""
    if not dist.is_initialized():
        return  # Topology raises the clear error
    types = group_device_types(dp_group)
    if device.type not in types:
        backend = dist.get_backend(dp_group if dp_group is not None else dist.group.WORLD)
        raise ValueError(f"OverlappedDDP: the parameters live on {device}, but the data-parallel group's backend "
                         f"({backend}) reduces only {sorted(types)} tensors: move the model to a device the group "
                         "serves (e.g. torch.cuda.current_device() for nccl) before wrapping it")


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def _check_speculative_step(config: OverlapConfig, param_shards: int, device: torch.device,
                            per_token: bool) -> None:
    """What the speculative step needs, checked before any collective (optimizer/speculative_step.py)."""
    flag = "speculative_step (--odo-speculative-step)"
    if per_token:
        raise ValueError(f"{flag} does not work with calculate_per_token_loss (--calculate-per-token-loss): "
                         "finalize_model_grads scales every step's gradients after the backward, which would roll "
                         "every round back")
    if param_shards > 1:
        raise ValueError(f"{flag} needs ZeRO-1/2 (full weights between steps); this plan shards parameters "
                         "(ZeRO-3 gathers each bucket's weights at its forward anyway)")
    if device.type != "cpu":
        raise ValueError(f"{flag} runs on CPU (gloo) in this version; on {device.type} the update would run on the "
                         "compute stream in the middle of backward")
    if not (config.overlap_grad_reduce and config.overlap_param_gather):
        raise ValueError(f"{flag} needs overlap_grad_reduce and overlap_param_gather (--overlap-grad-reduce, "
                         "--overlap-param-gather)")
