"""Model-state memory per rank: the formula of a sharding plan (seed 004 section IV-D) and the measured bytes.

[Note: the formula]
Seed 004 gives ``2P/s_p + 2P/s_g + 12P/s_os`` bytes for bf16 parameters and gradients and Adam with fp32 masters.
The ODO's terms, with ``P~`` the padded bucket elements (every bucket is padded to ``s_os`` equal shards, so
``P~/s_os`` is this rank's shard exactly) and ``P_r`` the real parameter elements inside this rank's shards:

- parameters: ``e_p * P~ / s_p`` (``e_p``: model dtype bytes): the full ParameterBuffer, or ZeRO-3's primary
  shards; with hpZ the secondary pieces add ``e_p * P~ / hpz`` (seed 000 section 3.2: memory traded for a backward
  gather inside the node);
- gradients: ``e_g * P~ / s_os`` for the reduced shard (``e_g``: 4 with ``grad_reduce_in_fp32``), plus
  ``e_g * P~`` for the full accumulation buffer when the step keeps full gradients (``s_g = 1 < s_os``), or else
  ``e_g * P_d`` for the deferred buckets' own buffers (parameters reduced over a model-parallel group first; see
  [Note: deferred buffers] in grad_sync.py); seed 004 counts only ``e_g * P/s_g`` because it frees the reduced
  shard into the optimizer's update;
- master weights: ``4 * P~ / s_os``, and 0 when the model is fp32 and the gather lossless (the ParameterBuffer's
  shard is then the master: no copy, unlike megatron-core's +4 bytes/param in fp32);
- optimizer states: ``k * P_r`` with k = 8 for Adam, 4 for SGD with momentum, 0 without (no state for padding);
- bucket pool: ``pool_size * e_g * (largest bucket)`` once a step has reduce-scattered from pooled buffers;
- gather pool (ZeRO-3): the full-weight buffers of gathered buckets, at most ``gather_pool_size`` x the largest
  bucket in steady state (a transient, like activations; reported, not part of the formula);
- frozen parameters (``requires_grad=False``): ``e_p * P_frozen`` on every rank under every plan. They are not
  bucketed, so ZeRO-3 does not shard them (DeepSpeed's ZeRO-3 and FSDP do): a large frozen base costs its full size
  per rank.
"""
from __future__ import annotations

from typing import Dict


def model_state_bytes(*, padded_numel: int, owned_numel: int, param_bytes: int, grad_bytes: int, param_shards: int,
                      optim_shards: int, full_grad_buffer: bool, master_bytes: int, state_bytes: int,
                      pool_bytes: int, hpz: int = 1, frozen_bytes: int = 0, deferred_numel: int = 0
                      ) -> Dict[str, int]:
    """The formula of the module note, per component, for one rank (``deferred_numel``: the deferred buckets'
    own buffers, inside the full buffer's count when there is one)."""
    shard = padded_numel // optim_shards
    return {"parameters": param_bytes * padded_numel // param_shards,
            "hpz_secondary": param_bytes * padded_numel // hpz if hpz > 1 else 0,
            "gradients": grad_bytes * shard + grad_bytes * (padded_numel if full_grad_buffer else deferred_numel),
            "master_weights": master_bytes * shard,
            "optimizer_states": state_bytes * owned_numel,
            "bucket_pool": pool_bytes,
            "frozen_parameters": frozen_bytes}


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def measured_model_state_bytes(ddp) -> Dict[str, int]:
    """Bytes of the tensors an OverlappedDDP chunk holds (the optimizer adds its own components)."""
    gs = ddp.grad_sync
    store = ddp.param_buffer
    return {"parameters": sum(_bytes(t) for t in store.flat.values()),
            "hpz_secondary": sum(_bytes(t) for t in getattr(store, "secondary_flat", {}).values()),
            "gradients": _bytes(ddp.main_grad_partition) + sum(_bytes(t) for t in gs._local.values())
            + sum(_bytes(t) for t in gs._deferred_own.values()),
            "bucket_pool": sum(p.allocated_bytes for p in gs.pools.values()),
            "gather_pool": store.gathered_bytes() if hasattr(store, "gathered_bytes") else 0,
            "frozen_parameters": sum(_bytes(p) for _, p in ddp.frozen_params)}
