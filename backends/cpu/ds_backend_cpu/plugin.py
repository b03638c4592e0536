"""Hook implementations of the CPU backend.

Semantics (docs/architecture.md §3.6): ``device_count`` is ``LOCAL_WORLD_SIZE`` (else 1), so
each rank of a ``torchrun`` job owns one "device"; the current device is the last ``set_device``, else
``LOCAL_RANK``, else 0; the torch device is always ``cpu``. Streams are synchronous and events
use a host clock. Memory is the process's resident set, capped by its limits. Pinned memory is
declared absent: a CPU-only torch cannot page-lock (``pin_memory()`` raises there).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import inspect
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_cpu import comm, memory, shm_groups, shm_p2p, shm_sync
from ds_backend_cpu.graph import CpuGraph
from ds_core import hookimpl
from ds_core.backend_kit import (
    HostDevice,
    HostEvent,
    HostStream,
    HostStreams,
    check_device_index,
    check_seed,
    require_device_index,
    require_int,
)
from ds_core.errors import ConfigError
from ds_core.ops.cpu_adam import cpu_adam_provider
from ds_core.ops.quantizer import quantizer_provider
from ds_core.types import (
    BackendInfo,
    DeterminismRecord,
    DeviceProperties,
    MemoryInfo,
    ProbeResult,
    SimpleOpProvider,
)

NAME = "cpu"

# --------------------------------------------------------------------------- backend


@hookimpl
def ds_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        device_type="cpu",
        priority=0,
        hookspec_version=3,
        vendor_version=md.version("torch"),
        description="host CPU; collectives over shared memory within a host, gloo across hosts",
    )


@hookimpl
def ds_backend_probe() -> ProbeResult:
    cores = len(os.sched_getaffinity(0))
    return ProbeResult(
        True,
        f"host CPU with {cores} usable cores; collectives over shared memory within a host "
        f"({shm_groups.ENV_ENABLE}=0 disables), gloo across hosts",
        ds_device_count(),
    )


@hookimpl
def ds_backend_capabilities() -> frozenset[str]:
    return frozenset({"memory_limits", "determinism", "graph_capture", "p2p"})


@hookimpl
def ds_backend_configure(options: Mapping[str, Any]) -> bool:
    if options:
        raise ConfigError(f"accelerator.cpu has no options; remove {', '.join(sorted(options))}")
    return True


# --------------------------------------------------------------------------- device

# The host as a device: the kit's one implementation (devices, current device, RNG, resident
# memory). What the CPU backend adds is below: range checks, the CPU's name, memory limits.
_host = HostDevice()


def _check(index: int | None) -> None:
    # The rule of every hook taking an index (ds_core/hookspecs): None, or an int in range.
    # The host is every "device", so nothing else depends on which one is named.
    if index is not None:
        check_device_index(index, _host.device_count(), "the cpu backend")


@hookimpl
def ds_device_count() -> int:
    return _host.device_count()


@hookimpl
def ds_device_current() -> int:
    return _host.current_device()


@hookimpl
def ds_device_set(index: int) -> bool:
    count = _host.device_count()
    if not 0 <= require_device_index(index) < count:
        raise ValueError(
            f"device index {index} is out of range: this process sees {count} cpu device(s) "
            f"(LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE', 'unset')})"
        )
    _host.set_device(index)
    return True


@hookimpl
def ds_device_synchronize(index: int | None) -> bool:
    _check(index)
    _host.synchronize()  # host work is complete when the call that queued it returns
    return True


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


@hookimpl
def ds_device_properties(index: int | None) -> DeviceProperties:
    _check(index)
    total, _available, limit = memory.memory_info()
    return DeviceProperties(
        name=_cpu_name(),
        index=ds_device_current() if index is None else index,
        total_memory=total,
        extra={
            "cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(),
            "memory_limit_source": limit.source if limit else "",
        },
    )


# --------------------------------------------------------------------------- rng


@hookimpl
def ds_rng_manual_seed(seed: int, all_devices: bool) -> bool:
    check_seed(seed)
    _host.manual_seed(seed)  # one generator for every device
    return True


@hookimpl
def ds_rng_get_state(index: int | None) -> torch.Tensor:
    _check(index)
    return _host.get_rng_state()


@hookimpl
def ds_rng_set_state(state: torch.Tensor, index: int | None) -> bool:
    _check(index)
    _host.set_rng_state(state)
    return True


@hookimpl
def ds_rng_default_generator(index: int | None) -> torch.Generator:
    _check(index)
    return _host.default_generators[0]


# --------------------------------------------------------------------------- streams


# One implementation for every synchronous device, in the kit (HostEvent and HostStream are
# re-exported here for code that imported them from this module).
_streams = HostStreams(_host.current_device)


@hookimpl
def ds_stream_create(index: int | None, priority: int) -> HostStream:
    _check(index)
    require_int("priority", priority)  # kept only: a host stream reorders nothing
    return _streams.create(index, priority)


@hookimpl
def ds_stream_current(index: int | None) -> HostStream:
    _check(index)
    return _streams.current(index)


@hookimpl
def ds_stream_default(index: int | None) -> HostStream:
    _check(index)
    return _streams.default


@hookimpl
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return _streams.use(stream)


@hookimpl
def ds_stream_event_create(enable_timing: bool) -> HostEvent:
    return HostEvent(enable_timing)


# --------------------------------------------------------------------------- memory


@hookimpl
def ds_memory_allocated(index: int | None) -> int:
    _check(index)
    return _host.memory_allocated()  # the resident set


@hookimpl
def ds_memory_max_allocated(index: int | None) -> int:
    _check(index)
    return _host.max_memory_allocated()


@hookimpl
def ds_memory_reset_peak(index: int | None) -> bool:
    _check(index)
    return _host.reset_peak_memory_stats()


@hookimpl
def ds_memory_reserved(index: int | None) -> int:
    _check(index)
    return _host.memory_reserved()  # the C allocator's cache is part of the resident set


@hookimpl
def ds_memory_stats(index: int | None) -> dict[str, int]:
    _check(index)
    return _host.memory_stats()


@hookimpl
def ds_memory_empty_cache() -> bool:
    _host.empty_cache()
    return True


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
    _check(index)
    total, available, limit = memory.memory_info()
    return MemoryInfo(
        total=total,
        available=available,
        limit=limit.limit if limit else None,
        limit_source=limit.source if limit else "",
    )


@hookimpl
def ds_memory_is_pinned(tensor: torch.Tensor) -> bool:
    return False  # a CPU-only torch cannot page-lock host memory


# --------------------------------------------------------------------------- dtypes


@hookimpl
def ds_dtype_supported() -> frozenset[torch.dtype]:
    return frozenset(
        {
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint8,
            torch.bool,
        }
    )


# --------------------------------------------------------------------------- graph


@hookimpl
def ds_graph_create() -> Any:
    return CpuGraph()


# --------------------------------------------------------------------------- comm


@hookimpl
def ds_comm_backend_name() -> str:
    return "gloo"


@hookimpl
def ds_comm_prepare() -> bool:
    if not (dist.is_available() and dist.is_gloo_available()):
        raise RuntimeError("this torch build has no gloo process-group backend")
    return True


# The collective hooks live in ds_backend_cpu.comm (shared memory within a host, gloo
# otherwise); pluggy finds them here, in the registered module.
ds_comm_all_reduce = comm.ds_comm_all_reduce
ds_comm_reduce_scatter = comm.ds_comm_reduce_scatter
ds_comm_all_gather = comm.ds_comm_all_gather
ds_comm_broadcast = comm.ds_comm_broadcast
ds_comm_all_to_all = comm.ds_comm_all_to_all
ds_comm_barrier = comm.ds_comm_barrier
# Point-to-point: shared-memory channels between two ranks of a host, gloo otherwise.
ds_comm_send = shm_p2p.ds_comm_send
ds_comm_recv = shm_p2p.ds_comm_recv
ds_comm_batch_isend_irecv = shm_p2p.ds_comm_batch_isend_irecv


# --------------------------------------------------------------------------- ops


def _fused_adamw_check() -> tuple[bool, str]:
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False, f"torch {torch.__version__} has no fused AdamW"
    return True, "torch.optim.AdamW(fused=True) runs on cpu in this torch"


class _ShmSyncProvider:
    """Listed so ``ds-core report`` says which synchronisation path the shared-memory
    collectives take here (they load the helper themselves)."""

    name = "shm_sync"

    def is_compatible(self) -> tuple[bool, str]:
        if not shm_groups.enabled():
            return False, f"{shm_groups.ENV_ENABLE}=0: every collective uses gloo"
        return shm_sync.compatibility()

    def load(self) -> Any:
        lib, why = shm_sync.build_helper()  # ds_core.ops keeps one loaded copy per process
        if lib is None:
            raise RuntimeError(f"op shm_sync: {why}")
        return lib

    def status(self) -> str:
        if not shm_groups.enabled():
            return f"inactive: {shm_groups.ENV_ENABLE}=0"
        return shm_sync.status()


@hookimpl
def ds_op_providers() -> list[Any]:
    return [
        SimpleOpProvider(
            "fused_adam", _fused_adamw_check, lambda: partial(torch.optim.AdamW, fused=True)
        ),
        cpu_adam_provider(),
        quantizer_provider(),
        _ShmSyncProvider(),
    ]


# --------------------------------------------------------------------------- determinism


@hookimpl
def ds_determinism_apply(enabled: bool) -> DeterminismRecord:
    record = DeterminismRecord()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    record.settings["torch.use_deterministic_algorithms"] = (previous, enabled)
    record.notes.append(
        "cpu results also depend on the thread count: keep torch.set_num_threads equal across runs"
    )
    return record


@hookimpl
def ds_determinism_restore(record: DeterminismRecord) -> bool:
    previous, _new = record.settings.get("torch.use_deterministic_algorithms", (None, None))
    if previous is not None:
        torch.use_deterministic_algorithms(bool(previous))
    for var, (old, _) in record.env.items():
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    return True


# --------------------------------------------------------------------------- launcher


@hookimpl
def ds_launcher_visible_devices_env() -> list[str]:
    return []  # ranks are processes; there is no device mask for the host


@hookimpl
def ds_launcher_env_prefixes() -> list[str]:
    return ["OMP_", "MKL_", "KMP_", "GLOO_", "MALLOC_"]
