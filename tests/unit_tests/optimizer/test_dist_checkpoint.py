"""The ODO's state through megatron-core dist-checkpointing (torch_dist): model-space blocks, resharded over DP and TP."""
import itertools

import pytest
import torch

from megatron_ext.optimizer.dist_checkpoint import flat_range_blocks


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


def _full(module, flat: dict, tp: int, swiglu: bool) -> dict:
    """Per-rank flat tensors (name -> this TP rank's flattened tensor) of every TP rank -> the unsplit tensors: split
    weights joined along their partition dim (SwiGLU's fc1 as its two halves, each joined), the rest TP rank 0's."""
    out = {}
    for name, p in module.named_parameters():
        parts = [f[name].reshape(p.shape) for f in flat]
        if not getattr(p, "tensor_model_parallel", False) or tp == 1:
            out[name] = parts[0]
        elif swiglu and "linear_fc1" in name:
            halves = [x.chunk(2, dim=p.partition_dim) for x in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=p.partition_dim)
        else:
            out[name] = torch.cat(parts, dim=p.partition_dim)
    return out


def _gpt_world(path: str, save: bool, tp: int, bucket_size: int, drop: bool = False):
    """Rank body: a bf16 megatron-core GPT (SwiGLU, biases) at TP ``tp`` under the ODO. ``save``: three steps, then
    ``dist_checkpointing.save`` of the model's and the optimizer's sharded state dicts (Megatron-LM's entries, its
    fully parallel save strategy). Else a fresh model (other weights) loads them. Returns, on rank 0, the unsplit
    weights and main weights and moments (every DP and TP rank's gathered), the step, the loaded param groups and
    how many pieces took more than one block. ``drop``: rank 0's model state dict lacks the final layer norm; returns
    each rank's error."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                                get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                             FullyParallelSaveStrategyWrapper)
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module

    import megatron_ext as mx
    from megatron_ext.compat import enable_cpu_compat
    from megatron_ext.models.gpt import build_gpt_model, synthetic_gpt_batch
    from megatron_ext.optimizer.checkpoint import merge_optimizer_shards
    from megatron_ext.training.initialize import set_seeds

    from ..training.test_checkpoint_import import _megatron_core_on_cpu

    ps.initialize_model_parallel(tp, 1)
    try:
        enable_cpu_compat()
        set_seeds(0 if save else 1)
        gpt = build_gpt_model(2, 24, 4, 64, 16, add_bias_linear=True, bf16=True, **SWIGLU)
        module = Float16Module(gpt.config, gpt)
        dp_group = ps.get_data_parallel_group()
        ddp = mx.OverlappedDDP(module, mx.OverlapConfig(bucket_size=bucket_size), dp_group)
        opt = mx.OverlappedDistributedOptimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                                bf16=True), ddp)
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "dp_cp_group": dp_group}
        if save:
            for step in range(3):
                b = synthetic_gpt_batch(2, 16, 64, seed=10 * step + ps.get_data_parallel_rank())
                opt.zero_grad()
                loss = ddp(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).float().mean()
                opt.scale_loss(loss).backward()
                ddp.finish_grad_sync()
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
        local = opt.state_dict()
        shards = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(shards, local, group=dp_group)
        merged = merge_optimizer_shards(shards)
        per_tp = [None] * tp
        mine = {"weights": {n: p.detach().float().reshape(-1) for n, p in module.named_parameters()},
                **{k: {n: e[k] for n, e in merged["params"].items()} for k in ("master", "exp_avg", "exp_avg_sq")}}
        dist.all_gather_object(per_tp, mine, group=ps.get_tensor_model_parallel_group())
        if dist.get_rank() != 0:
            return None
        return ({k: _full(module, [m[k] for m in per_tp], tp, True) for k in mine},
                merged["step"], [(g["lr"], g["weight_decay"]) for g in opt.param_groups], straddling)
    finally:
        ps.destroy_model_parallel()


def test_torch_dist_checkpoint_resumes_at_other_dp_and_tp_sizes(spawn, tmp_path):
    """Saved at DP 2 (buckets small enough that parameters straddle shards, so their blocks are partial rows),
    the state loads at TP 2 (megatron-core reads each TP rank's half; SwiGLU's fc1 as its two halves) and at DP 1
    with one bucket: the weights, every main weight and both moments equal the saved ones bit for bit, and the step
    and param groups carry over."""
    path = str(tmp_path / "ckpt")
    (saved, step, groups, straddling), _ = spawn(_gpt_world, 2, path, True, 1, 1000, timeout=180)
    assert step == 3 and straddling > 0
    for world, tp, bucket in ((2, 2, 700), (1, 1, 10 ** 6)):
        got = spawn(_gpt_world, world, path, False, tp, bucket, timeout=180)[0]
        assert got[1] == step and got[2] == groups
        for kind, tensors in saved.items():
            assert got[0][kind].keys() == tensors.keys()
            for name, t in tensors.items():
                assert torch.equal(got[0][kind][name], t), (world, tp, kind, name)


def test_a_parameter_missing_from_the_models_state_fails_every_rank(spawn, tmp_path):
    """One rank's model sharded state dict lacks a parameter: every rank raises (none is left waiting in the save's
    first collective), that rank naming it."""
    errors = spawn(_gpt_world, 2, str(tmp_path / "c"), True, 1, 1000, True, timeout=180)
    assert errors[0].startswith("the model's sharded_state_dict has no tensor for module.decoder.final_layernorm.weight")
    assert errors[1].startswith("the model's sharded_state_dict has no tensor for a parameter on another rank")


def test_megatron_sharding_types_other_than_model_space_are_refused_by_name():
    import types

    from megatron_ext.optimizer.dist_checkpoint import sharded_optimizer_state

    opt = types.SimpleNamespace(chunks=[types.SimpleNamespace(plan=types.SimpleNamespace(param=1))])
    with pytest.raises(ValueError, match="not 'dp_reshardable': this checkpoint's .* --no-load-optim"):
        sharded_optimizer_state(opt, {}, True, {"distrib_optim_sharding_type": "dp_reshardable"})
    with pytest.raises(ValueError, match="--dist-ckpt-optim-fully-reshardable\), not 'dp_reshardable'$"):
        sharded_optimizer_state(opt, {}, False, {"distrib_optim_sharding_type": "dp_reshardable"})
