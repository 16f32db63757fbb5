"""Gloo process groups that share one transport device per process (shim 6 of the package note).

Why: without CUDA every process group is a gloo group, and each ``dist.new_group`` gives torch's
``ProcessGroupGloo`` a transport device of its own, whose event-loop thread wakes every 10 ms whether or not the
group is used. megatron-core's ``initialize_model_parallel`` builds 20 groups at TP = PP = 1 and the ODO five more:
26 loop threads per rank. Idle, they took 39 ms of CPU per second per process here (measured with
``/proc/<pid>/task/*/schedstat``, two ranks of 25 groups: 7 ms with one shared device), and a training step of four
ranks on two cores lost that much compute to them. gloo's TCP device is built to serve many contexts (its listener
matches each incoming connection to its pair by a sequence number), so the groups made after this shim is installed
get one device, built the way torch builds its own (``GLOO_SOCKET_IFNAME`` respected); the world group made by
``init_process_group`` before it keeps its own.

Each process builds its device once: a forked child builds a new one (the parent's loop thread does not exist
there). ``MEGATRON_EXT_GLOO_SHARED_DEVICE=0`` turns the sharing off (a device per group, torch's default).
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

_SHARED: Optional[Tuple[int, List[Any]]] = None   # (pid, devices) of the process that built them


def shared_device_enabled() -> bool:
    return os.environ.get("MEGATRON_EXT_GLOO_SHARED_DEVICE", "1").strip().lower() not in ("0", "false", "off", "no")


def _shared_devices(gloo: Any) -> List[Any]:
    """This process's devices, built on first use as torch builds a group's own."""
    global _SHARED
    if _SHARED is None or _SHARED[0] != os.getpid():
        ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if len(ifnames) > 1:
            devices = [gloo.create_device(interface=name) for name in ifnames.split(",") if name]
        else:
            devices = [gloo.create_default_device()]
        _SHARED = (os.getpid(), devices)
    return _SHARED[1]


def patch_gloo_groups() -> bool:
    """Make the gloo groups created from now on share this process's device. Returns whether it is installed."""
    if not shared_device_enabled():
        return False
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_mx_shared_device", False):
        return True

    class SharedDeviceGloo(base):   # a subclass: torch's isinstance checks on ProcessGroupGloo still hold
        _mx_shared_device = True

        def __init__(self, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> None:
            options = args[0] if args else kwargs.get("options", kwargs.get("timeout"))
            if isinstance(options, base._Options):   # a caller with its own options keeps them
                super().__init__(store, rank, size, options)
                return
            opts = base._Options()
            opts._devices = _shared_devices(base)
            opts._threads = 2 * len(opts._devices)   # torch's own rule: two workers per device
            if options is not None:
                opts._timeout = options
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = SharedDeviceGloo
    return True
