"""Gloo process groups that share one transport device per process (shim 6 of the package note).

Why: without CUDA every process group is a gloo group, and each ``dist.new_group`` gives torch's
``ProcessGroupGloo`` a transport device of its own, whose event-loop thread wakes every 10 ms whether or not the
group is used. megatron-core's ``initialize_model_parallel`` builds 20 groups at TP = PP = 1 and the ODO five more:
26 loop threads per rank. Idle, two ranks of 25 groups took 39 ms of CPU per second each (``/proc/<pid>/task/*/
schedstat``; 7 ms with one shared device), on hosts where the ranks share a few cores with the compute. gloo's TCP
device serves any number of contexts (its listener matches each incoming connection to its pair by a sequence
number), so the groups made after this shim is installed get one device, built the way torch builds its own
(``GLOO_SOCKET_IFNAME`` respected); the world group, made by ``init_process_group`` before it, keeps its own. The
price: one loop thread receives for every group of the process, which on a host with many idle cores and several
busy groups at once could become the bottleneck (the switch below gives torch's layout back).

Each process builds its device once: a forked child builds a new one (the parent's loop thread does not exist
there) and never frees its copies of the parent's. ``MEGATRON_EXT_GLOO_SHARED_DEVICE=0`` turns the sharing off (a
device per group, torch's default).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

_SHARED: Optional[Tuple[int, List[Any]]] = None   # (pid, devices) of the process that built them
# A forked child's copies of its parent's devices: never freed there, since freeing one joins an event-loop thread
# that does not exist in the child.
_INHERITED: List[Any] = []


def shared_device_enabled() -> bool:
    return os.environ.get("MEGATRON_EXT_GLOO_SHARED_DEVICE", "1").strip().lower() not in ("0", "false", "off", "no")


def _shared_devices(gloo: Any) -> List[Any]:
    """This process's devices, built on first use as torch builds a group's own."""
    global _SHARED
    if _SHARED is None or _SHARED[0] != os.getpid():
        if _SHARED is not None:
            _INHERITED.extend(_SHARED[1])
        ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if len(ifnames) > 1:
            devices = [gloo.create_device(interface=name) for name in ifnames.split(",") if name]
        else:
            devices = [gloo.create_default_device()]
        _SHARED = (os.getpid(), devices)
    return _SHARED[1]


def _shared_device_class(base: type) -> type:
    """A stand-in for torch's ``ProcessGroupGloo`` in ``distributed_c10d``: calling it builds a ``ProcessGroupGloo``
    on this process's shared device; ``isinstance`` and ``issubclass`` against it mean ``ProcessGroupGloo`` (torch
    checks backends that way, e.g. to set a group's timeout), whichever device the backend has."""

    class SharedDeviceMeta(type(base)):
        def __call__(cls, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> Any:
            options = args[0] if args else kwargs.get("options", kwargs.get("timeout"))
            if isinstance(options, base._Options):   # a caller with its own options keeps them
                return base(store, rank, size, options)
            opts = base._Options()
            opts._devices = _shared_devices(base)
            opts._threads = 2 * len(opts._devices)   # torch's own rule: two workers per device
            if options is not None:
                opts._timeout = options
            return base(store, rank, size, opts)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, base)

    class SharedDeviceGloo(base, metaclass=SharedDeviceMeta):
        _mx_shared_device = True

    return SharedDeviceGloo


def patch_gloo_groups() -> bool:
    """Make the gloo groups created from now on share this process's device. Returns whether it is installed."""
    if not shared_device_enabled():
        return False
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    from torch.distributed import distributed_c10d as c10d

    if not getattr(c10d.ProcessGroupGloo, "_mx_shared_device", False):
        c10d.ProcessGroupGloo = _shared_device_class(c10d.ProcessGroupGloo)
    return True
