"""The ODO's state through megatron-core dist-checkpointing (torch_dist): model-space blocks, resharded over DP and TP."""
import itertools

import pytest
import torch

from megatron_ext.optimizer.dist_checkpoint import (SHARDED_FORMAT, SHARDED_FORMATS, flat_range_blocks,
                                                    megatron_common, sharded_header)


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 5), (1, 1, 6), (4, 1, 2, 3)])
def test_flat_range_blocks_are_the_range_in_order(shape):
    """Every range [start, end) of the flattened tensor is the blocks' elements, each block a contiguous run of the
    flattened tensor following the one before, at most 2 * ndim - 1 of them."""
    numel = int(torch.tensor(shape).prod().item()) if shape else 1
    t = torch.arange(numel).reshape(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        blocks = flat_range_blocks(shape, start, end)
        assert len(blocks) <= max(1, 2 * len(shape) - 1), (shape, start, end, blocks)
        got = [t[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in blocks]
        assert torch.equal(torch.cat(got), torch.arange(start, end)), (shape, start, end, blocks)
    assert flat_range_blocks(shape, 3, 3) == []


SWIGLU = dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu)


def _global_tensors(gpt, flat: dict) -> dict:
    """This rank's flat tensors (parameter name -> flattened tensor) as the parts of the tensors megatron-core saves
    them in: (key, layer) -> [(offset in the layer's tensor, its shape there, the part)]; the pipeline-tied copy of
    the word embeddings left out (the first stage's is saved)."""
    from megatron_ext.optimizer.dist_checkpoint import model_tensors

    tensors = model_tensors(gpt.sharded_state_dict())
    out = {}
    for name, p in gpt.named_parameters():
        parts = tensors[id(p)]
        if isinstance(parts[0][0].replica_id, tuple) and parts[0][0].replica_id[0] != 0:
            continue
        x = flat["module." + name].reshape(-1)
        for t, off in parts:   # (SwiGLU's fc1: its two halves, each a part of its own tensor)
            n, k = t.prepend_axis_num, (t.key, t.global_offset[:t.prepend_axis_num])
            out.setdefault(k, []).append((t.global_offset[n:], t.global_shape[n:],
                                          x[off:off + t.data.numel()].reshape(t.local_shape)))
    return out


def _join(per_rank: list) -> dict:
    """Every rank's :func:`_global_tensors` -> each saved tensor whole, every element from some rank (the TP copies
    of a replicated tensor are one part)."""
    parts = {}
    for tensors in per_rank:
        for k, ps in tensors.items():
            parts.setdefault(k, []).extend(ps)
    joined = {}
    for k, ps in parts.items():
        full = torch.full(ps[0][1], float("nan"))
        for offset, _, x in ps:
            full[tuple(slice(o, o + s) for o, s in zip(offset, x.shape))] = x
        assert not full.isnan().any(), k
        joined[k] = full
    return joined


def _gpt_world(path: str, save: bool, tp: int, pp: int, bucket_size: int, drop: bool = False):
    """Rank body: a bf16 megatron-core GPT (SwiGLU, biases, tied embeddings) at TP ``tp`` and PP ``pp`` under the ODO.
    ``save``: three steps through megatron-core's schedule, then ``dist_checkpointing.save`` of the model's and the
    optimizer's sharded state dicts (Megatron-LM's entries, its fully parallel save strategy). Else a fresh model
    (other weights) loads them. Returns, on rank 0, every saved tensor whole (the weights, main weights and moments
    of every rank, by megatron-core's key and layer), the step, the loaded param groups and how many pieces took
    more than one block. ``drop``: rank 0's model state dict lacks the final layer norm; returns each rank's error."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                                get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                             FullyParallelSaveStrategyWrapper)
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    import megatron_ext as mx
    from megatron_ext.compat import enable_cpu_compat
    from megatron_ext.models.gpt import build_gpt_model, gpt_forward_step, synthetic_gpt_batch
    from megatron_ext.optimizer.checkpoint import merge_optimizer_shards
    from megatron_ext.optimizer.megatron_config import attach_to_schedules
    from megatron_ext.training.initialize import set_seeds

    from ..training.test_checkpoint_import import _megatron_core_on_cpu

    ps.initialize_model_parallel(tp, pp)
    try:
        enable_cpu_compat()
        set_seeds(0 if save else 1)
        gpt = build_gpt_model(2, 24, 4, 64, 16, add_bias_linear=True, bf16=True, pipeline_dtype=torch.bfloat16,
                              share_embeddings_and_output_weights=True, **SWIGLU)
        module = Float16Module(gpt.config, gpt)
        dp_group = ps.get_data_parallel_group()
        ddp = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=bucket_size), dp_group)
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                                bf16=True), ddp)
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "dp_cp_group": dp_group}
        if save:
            attach_to_schedules(ddp, opt)
            for step in range(3):
                batches = [synthetic_gpt_batch(2, 16, 64, seed=10 * step + ps.get_data_parallel_rank())]
                opt.zero_grad()
                get_forward_backward_func()(forward_step_func=gpt_forward_step, data_iterator=iter(batches),
                                            model=[ddp], num_microbatches=1, seq_length=16, micro_batch_size=2,
                                            forward_only=False)
                assert opt.step()[0]
        state = {"model": ddp.sharded_state_dict()}
        if drop:   # (rank 0 holds the final layer norm's state)
            if dist.get_rank() == 0:
                del state["model"]["decoder.final_layernorm.weight"]
            try:
                opt.sharded_state_dict(state, metadata=metadata)
            except ValueError as e:
                return str(e)
            return None
        state["optimizer"] = opt.sharded_state_dict(state, is_loading=not save, metadata=metadata)
        straddling = sum(len(e["param"]) > 1 for e in state["optimizer"]["param_state"].values())
        with _megatron_core_on_cpu():
            if save:
                if dist.get_rank() == 0:
                    import os
                    os.makedirs(path, exist_ok=True)
                dist.barrier()
                dist_checkpointing.save(state, path, FullyParallelSaveStrategyWrapper(
                    get_default_save_sharded_strategy(), dp_group))
            else:
                loaded = dist_checkpointing.load(state, path, FullyParallelLoadStrategyWrapper(
                    get_default_load_sharded_strategy(path), dp_group))
                ddp.load_state_dict(loaded["model"])
                opt.load_state_dict(loaded["optimizer"])
        opt.force_param_sync()
        shards = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(shards, opt.state_dict(), group=dp_group)
        merged = merge_optimizer_shards(shards)
        mine = {"weights": {n: p.detach().float().reshape(-1) for n, p in module.named_parameters()},
                **{k: {n: e[k] for n, e in merged["params"].items()} for k in ("master", "exp_avg", "exp_avg_sq")}}
        mine = {k: _global_tensors(gpt, v) for k, v in mine.items()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        straddling = torch.tensor([straddling])
        dist.all_reduce(straddling)
        if dist.get_rank() != 0:
            return None
        return ({k: _join([m[k] for m in everyone]) for k in mine}, merged["step"],
                [(g["lr"], g["weight_decay"]) for g in opt.param_groups], straddling.item())
    finally:
        ps.destroy_model_parallel()


def test_torch_dist_checkpoint_resumes_at_other_dp_tp_and_pp_sizes(spawn, tmp_path):
    """Saved at DP 2 x PP 2 (buckets small enough that parameters straddle shards, so their blocks are partial rows;
    the embeddings tied across the stages), the state loads at TP 2 x DP 1 x PP 1 with other buckets (megatron-core
    reads each TP rank's half; SwiGLU's fc1 as its two halves): the weights, every main weight and both moments
    equal the saved ones bit for bit, and the step and param groups carry over."""
    path = str(tmp_path / "ckpt")
    (saved, step, groups, straddling), *_ = spawn(_gpt_world, 4, path, True, 1, 2, 1000, timeout=240)
    assert step == 3 and straddling > 0
    for world, tp, bucket in ((2, 2, 700),):
        got = spawn(_gpt_world, world, path, False, tp, 1, bucket, timeout=180)[0]
        assert got[1] == step and got[2] == groups
        for kind, tensors in saved.items():
            assert got[0][kind].keys() == tensors.keys()
            for name, t in tensors.items():
                assert torch.equal(got[0][kind][name], t), (world, tp, kind, name)


def test_a_parameter_missing_from_the_models_state_fails_every_rank(spawn, tmp_path):
    """One rank's model sharded state dict lacks a parameter: every rank raises (none is left waiting in the save's
    first collective), that rank naming it."""
    errors = spawn(_gpt_world, 2, str(tmp_path / "c"), True, 1, 1, 1000, True, timeout=180)
    assert errors[0].startswith("the model's sharded_state_dict has no tensor for module.decoder.final_layernorm.weight")
    assert errors[1] == "the optimizer state cannot be placed in the model's sharded_state_dict on another rank " \
        "(nothing was saved or loaded)"


def test_the_shared_part_reads_as_megatrons_and_as_the_odos_of_either_version():
    """The common entries Megatron's DistributedOptimizer reads (its state_dict()'s shape: groups without their
    parameters or the ODO's group key, each with the step and whether to correct the bias; the dynamic scaler's
    scale as a one-element tensor, which megatron-core's scaler moves to the GPU), beside the ODO's own header, which
    reads the same from a checkpoint of the first version (update rule under "optimizer"). The way back through
    Megatron's own optimizer: tests/unit_tests/megatron_lm/test_plugin.py."""
    groups = [{"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
               "overrides": None},
              {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
               "overrides": (("wd_mult", 0.0),)}]
    scaler = {"scale": 1024.0, "growth_tracker": 3, "hysteresis_tracker": 2}
    shared = {"optimizer": "AdamW", "step": 7, "param_groups": groups, "grad_scaler": scaler}
    common = megatron_common(shared)
    # (bias_correction: what TE's and apex's FusedAdam read from a group, which torch's Adam has not)
    assert common["optimizer"]["param_groups"] == [{"bias_correction": True, "step": 7,
                                                    **{k: v for k, v in g.items() if k != "overrides"}}
                                                   for g in groups]
    assert torch.equal(common["grad_scaler"]["scale"], torch.tensor([1024.0]))
    assert common["grad_scaler"]["growth_tracker"] == 3 and megatron_common({**shared, "grad_scaler": None})[
        "grad_scaler"] is None
    new = {"format": SHARDED_FORMAT, "update_rule": "AdamW", "step": 7, "param_groups": groups, "has_state": True,
           **common}
    old = {"format": SHARDED_FORMATS[1], "optimizer": "AdamW", "step": 7, "param_groups": groups, "has_state": True,
           "grad_scaler": scaler}
    assert sharded_header(new) == sharded_header(old) == {**shared, "has_state": True}


def test_megatron_sharding_types_other_than_model_space_are_refused_by_name():
    import types

    from megatron_ext.optimizer.dist_checkpoint import sharded_optimizer_state

    opt = types.SimpleNamespace(chunks=[types.SimpleNamespace(plan=types.SimpleNamespace(param=1))])
    with pytest.raises(ValueError, match="not 'dp_reshardable': this checkpoint's .* --no-load-optim"):
        sharded_optimizer_state(opt, {}, True, {"distrib_optim_sharding_type": "dp_reshardable"})
    with pytest.raises(ValueError, match="--dist-ckpt-optim-fully-reshardable\), not 'dp_reshardable'$"):
        sharded_optimizer_state(opt, {}, False, {"distrib_optim_sharding_type": "dp_reshardable"})


class FusedAdam(torch.optim.AdamW):   # (named as apex names it: the ODO knows it by name)
    """apex's FusedAdam as far as checkpoints see it (CUDA hosts with apex build it): the step counted per param
    group, none per parameter."""

    def __init__(self, params, adam_w_mode: bool = True, **kwargs):
        super().__init__(params, **kwargs)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if self.state.get(p):
                    self.state[p]["step"] = torch.tensor(float(g.get("step", 0)))
        out = super().step(closure)
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            for p in g["params"]:
                self.state[p].pop("step", None)
        return out


def _small_run(path: str, save: bool, optimizer: str, bucket_size: int, fmt: str):
    """A small MLP under the ODO with ``optimizer`` (``fused_adam``: :class:`FusedAdam`; ``sgd``: with momentum), its
    model sharded state dict built as megatron-core builds one. ``save``: three steps, the save (``fmt``:
    ``torch_dist``, or ``canonical``: ``state_dict()`` merged), then a fourth step; else the load and the fourth step.
    Returns the weights after the fourth step."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer import OptimizerConfig

    import megatron_ext as mx
    from megatron_ext.optimizer import inner_optimizer
    from megatron_ext.optimizer.checkpoint import merge_optimizer_shards

    from ..training.test_checkpoint_import import _megatron_core_on_cpu

    torch.manual_seed(0 if save else 1)
    module = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 7))
    ddp = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=bucket_size))
    config = OptimizerConfig(optimizer="adam" if optimizer == "fused_adam" else "sgd", lr=1e-2, sgd_momentum=0.9,
                             weight_decay=0.1)
    with mock.patch.object(inner_optimizer, "_apex_fused_adam", lambda groups: FusedAdam):
        opt = mx.OverlappedDistributedOptimizer(config, ddp)
    assert (type(opt.inner).__name__ == "FusedAdam") == (optimizer == "fused_adam")
    rank = dist.get_rank()

    def step(i):
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(10 * i + rank))
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]

    if save:
        for i in range(3):
            step(i)
    if fmt == "canonical":
        if save:
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, opt.state_dict())
            if rank == 0:
                torch.save(merge_optimizer_shards(shards), f"{path}/optim.pt")
            dist.barrier()
        else:
            opt.load_state_dict(torch.load(f"{path}/optim.pt", weights_only=False))
    else:
        model = {n: ShardedTensor.from_rank_offsets(n, p, replica_id=(0, 0, rank))
                 for n, p in module.named_parameters()}
        with _megatron_core_on_cpu():
            if save:
                dist_checkpointing.save({"optimizer": opt.sharded_state_dict(model)}, path)
            else:
                loaded = dist_checkpointing.load({"optimizer": opt.sharded_state_dict(model, is_loading=True)}, path)
                opt.load_state_dict(loaded["optimizer"])
    step(3)
    opt.force_param_sync()
    return [p.detach().clone() for p in module.parameters()]


def _save_and_resume(path: str, optimizer: str, fmt: str):
    """Rank body: the uninterrupted run (buckets of 100 elements) and, from its checkpoint, the resumed one (one
    bucket); their weights after the fourth step."""
    return _small_run(path, True, optimizer, 100, fmt), _small_run(path, False, optimizer, 10 ** 6, fmt)


@pytest.mark.parametrize("optimizer, fmt", [("fused_adam", "torch_dist"), ("sgd", "torch_dist"),
                                            ("fused_adam", "canonical")])
def test_resume_continues_exactly_whatever_keeps_the_step_and_state(spawn, tmp_path, optimizer, fmt):
    """apex's FusedAdam keeps the step per param group and SGD keeps none (its momentum is its state): saved at
    DP 2 and resumed at DP 2 with other buckets, the fourth step gives the uninterrupted run's weights bit for bit
    (bias correction restarted at step 1, or the momentum dropped, would not); FusedAdam's step through the
    canonical state too."""
    for want, got in spawn(_save_and_resume, 2, str(tmp_path), optimizer, fmt, timeout=120):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
