"""Run megatron-core 0.16.1 on CPU / gloo: one place for every CUDA-only spot we route around.

Call :func:`enable_cpu_compat` once per process (after ``import megatron.core``-using code is importable, before
building models). It is idempotent and a no-op when CUDA is available, so GPU runs are untouched.

[Note: the shims, and why each exists]
megatron-core assumes a GPU in a handful of places that the GPT path (local spec, ``use_cpu_initialization=True``)
and the pipeline schedules hit. Each shim below is installed only when ``torch.cuda.is_available()`` is False:

1. ``torch.cuda.current_device()`` returns ``torch.device("cpu")``. RoPE, the GlobalMemoryBuffer, the
   tensor-parallel gather/scatter mappings and p2p shape exchange pass it as ``device=``; on a CPU build it raises.
2. ``torch.cuda.synchronize()`` is a no-op (p2p communication calls it after batched isend/irecv).
3. The CUDA RNG tracker (``tensor_parallel.random``) keeps CPU generator states instead of CUDA ones: ``add``
   seeds a CPU state, ``fork`` swaps the CPU RNG to the named state and back, and ``_get/_set_cuda_rng_state``
   (used by activation recomputation) read and write the CPU RNG. Dropout inside TP regions therefore still gets
   per-TP-rank streams, like on GPU.
4. The default causal / sliding-window masks (``transformer.utils``, imported by ``fusions.fused_softmax``) are
   built with ``device="cuda"``; we rebind them to CPU builders. :func:`causal_attention_mask` gives the same mask
   for callers who prefer to pass ``attention_mask`` explicitly.
5. The pipeline schedules (``forward_backward_no_pipelining`` / ``_pipelining_without_interleaving`` /
   ``_with_interleaving``) allocate ``torch.zeros(..., device="cuda")``; we wrap them so they run under
   :class:`CudaToCpuMode`, a ``TorchFunctionMode`` that maps ``device="cuda"`` to CPU in factory calls and makes
   ``Tensor.cuda()`` an identity. ``get_forward_backward_func`` looks the schedules up by module global, so it
   returns the wrapped ones. The mode is scoped to the schedule call, not process-wide, to keep its overhead
   off everything else.
6. Every ``dist.new_group`` made afterwards is a gloo group with its own transport device and event-loop thread,
   which wakes every 10 ms: with megatron-core's 20 groups and the ODO's five, 26 such threads per rank (idle,
   25 groups took 39 ms of CPU per second per process).
   They share one device per process instead (``gloo_groups.py``; ``MEGATRON_EXT_GLOO_SHARED_DEVICE=0``: off).
"""
from __future__ import annotations

from .cpu import CudaToCpuMode, causal_attention_mask, cpu_compat_enabled, cpu_device_mode, enable_cpu_compat

__all__ = ["enable_cpu_compat", "cpu_compat_enabled", "cpu_device_mode", "CudaToCpuMode", "causal_attention_mask"]
