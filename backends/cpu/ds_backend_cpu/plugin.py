"""Hook implementations of the CPU backend.

Semantics (DESIGN.md §3, CPU): ``device_count`` is ``LOCAL_WORLD_SIZE`` (else 1), so each rank
of a ``torchrun`` job owns one "device"; the current device is the last ``set_device``, else
``LOCAL_RANK``, else 0; the torch device is always ``cpu``. Streams are synchronous and events
use a host clock. Memory is the process's resident set, capped by its limits. Pinned memory is
declared absent: a CPU-only torch cannot page-lock (``pin_memory()`` raises there).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import inspect
import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_cpu import memory
from ds_core import hookimpl
from ds_core.backend_kit import HostEvent, HostStream, HostStreams
from ds_core.comm import DefaultCollectives, torch_reduce_op
from ds_core.errors import ConfigError
from ds_core.types import (
    COMPLETED,
    BackendInfo,
    DeterminismRecord,
    DeviceProperties,
    MemoryInfo,
    ProbeResult,
    SimpleOpProvider,
    Work,
)

NAME = "cpu"

# --------------------------------------------------------------------------- backend


@hookimpl
def ds_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        device_type="cpu",
        priority=0,
        hookspec_version=1,
        vendor_version=md.version("torch"),
        description="host CPU; collectives over gloo",
    )


@hookimpl
def ds_backend_probe() -> ProbeResult:
    cores = len(os.sched_getaffinity(0))
    return ProbeResult(True, f"host CPU with {cores} usable cores", ds_device_count())


@hookimpl
def ds_backend_capabilities() -> frozenset[str]:
    return frozenset({"memory_limits", "determinism", "graph_capture"})


@hookimpl
def ds_backend_configure(options: Mapping[str, Any]) -> bool:
    if options:
        raise ConfigError(f"accelerator.cpu has no options; remove {', '.join(sorted(options))}")
    return True


# --------------------------------------------------------------------------- device

_current: int | None = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


@hookimpl
def ds_device_count() -> int:
    return max(_env_int("LOCAL_WORLD_SIZE", 1), 1)


@hookimpl
def ds_device_current() -> int:
    global _current
    if _current is None:  # read the launcher's choice once: this is a hot path
        _current = _env_int("LOCAL_RANK", 0)
    return _current


@hookimpl
def ds_device_set(index: int) -> bool:
    global _current
    count = ds_device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"device index {index} is out of range: this process sees {count} cpu device(s) "
            f"(LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE', 'unset')})"
        )
    _current = index
    return True


@hookimpl
def ds_device_synchronize(index: int | None) -> bool:
    return True  # host work is complete when the call that queued it returns


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
    torch.manual_seed(seed)
    return True


@hookimpl
def ds_rng_get_state(index: int | None) -> torch.Tensor:
    return torch.get_rng_state()


@hookimpl
def ds_rng_set_state(state: torch.Tensor, index: int | None) -> bool:
    torch.set_rng_state(state)
    return True


@hookimpl
def ds_rng_default_generator(index: int | None) -> torch.Generator:
    return torch.default_generator


# --------------------------------------------------------------------------- streams


# One implementation for every synchronous device, in the kit (HostEvent and HostStream are
# re-exported here for code that imported them from this module).
_streams = HostStreams(ds_device_current)


@hookimpl
def ds_stream_create(index: int | None, priority: int) -> HostStream:
    return _streams.create(index, priority)


@hookimpl
def ds_stream_current(index: int | None) -> HostStream:
    return _streams.current(index)


@hookimpl
def ds_stream_default(index: int | None) -> HostStream:
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
    return memory.resident_bytes()


@hookimpl
def ds_memory_max_allocated(index: int | None) -> int:
    return max(memory.peak_resident_bytes(), memory.resident_bytes())


@hookimpl
def ds_memory_reset_peak(index: int | None) -> bool:
    return memory.reset_peak()


@hookimpl
def ds_memory_reserved(index: int | None) -> int:
    return memory.resident_bytes()  # the C allocator's cache is part of the resident set


@hookimpl
def ds_memory_stats(index: int | None) -> dict[str, int]:
    current, peak = memory.resident_bytes(), memory.peak_resident_bytes()
    return {
        "allocated_bytes.all.current": current,
        "allocated_bytes.all.peak": max(peak, current),
        "reserved_bytes.all.current": current,
    }


@hookimpl
def ds_memory_empty_cache() -> bool:
    memory.trim()
    return True


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
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
    from ds_backend_cpu.graph import CpuGraph  # dispatch-mode machinery only when asked for

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


# Two measured facts about gloo shape the collective hooks below:
# - its native reduce-scatter and all-gather each take longer than an all-reduce of the whole
#   buffer (bench/gloo_collectives.py: 1.66x and 1.39x at 32 MiB, 2 ranks), so both run as an
#   in-place all-reduce; bool tensors cannot be summed and keep the native all-gather;
# - it has no int16 collectives at all ("Invalid scalar type"), so int16 tensors travel as int32
#   and are narrowed on arrival. That is exact: narrowing wraps modulo 2**16 as int16 sums do.
_WIDEN = {torch.int16: torch.int32}
_DEFAULT = DefaultCollectives()


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when gloo carries its dtype, else a widened copy."""
    return t.to(_WIDEN[t.dtype]) if t.dtype in _WIDEN else t


def _world_and_rank(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class _ThenFinish:
    """Handle of an all-reduce that still has a local step (copy a chunk, divide) on wait()."""

    __slots__ = ("_finish", "_work")

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> bool:
        if self._finish is not None:
            self._work.wait()
            self._finish()
            self._finish = None
        return True


def _then(work: Any, async_op: bool, finish: Callable[[], None]) -> Work:
    handle = _ThenFinish(work, finish)
    if async_op:
        return handle
    handle.wait()
    return COMPLETED


@hookimpl
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    if tensor.dtype not in _WIDEN:
        return _DEFAULT.ds_comm_all_reduce(tensor, op, group, async_op)
    wide = _wide(tensor)
    return _then(
        _DEFAULT.ds_comm_all_reduce(wide, op, group, True), async_op, lambda: tensor.copy_(wide)
    )


@hookimpl
def ds_comm_broadcast(tensor: torch.Tensor, src: int, group: Any, async_op: bool) -> Work:
    if tensor.dtype not in _WIDEN:
        return _DEFAULT.ds_comm_broadcast(tensor, src, group, async_op)
    wide = _wide(tensor)
    return _then(
        _DEFAULT.ds_comm_broadcast(wide, src, group, True), async_op, lambda: tensor.copy_(wide)
    )


@hookimpl
def ds_comm_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
    async_op: bool,
) -> Work:
    if input.dtype not in _WIDEN:
        return _DEFAULT.ds_comm_all_to_all(
            output, input, output_split_sizes, input_split_sizes, group, async_op
        )
    wide_out = torch.empty_like(output, dtype=_WIDEN[output.dtype])
    work = _DEFAULT.ds_comm_all_to_all(
        wide_out, _wide(input), output_split_sizes, input_split_sizes, group, True
    )
    return _then(work, async_op, lambda: output.copy_(wide_out))


@hookimpl
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    """Reduce-scatter as an all-reduce of ``input`` in place, then a copy of this rank's chunk.

    The spec lets ``input`` serve as scratch.
    """
    world, rank = _world_and_rank(group)
    if input.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter input has {input.numel()} elements, expected {output.numel() * world}"
        )
    flat, n = _wide(input).view(-1), output.numel()

    def finish() -> None:
        output.view(-1).copy_(flat[rank * n : (rank + 1) * n])
        if op == "avg":
            output.div_(world)

    torch_op = dist.ReduceOp.SUM if op == "avg" else torch_reduce_op(op)
    return _then(dist.all_reduce(flat, torch_op, group=group, async_op=True), async_op, finish)


@hookimpl
def ds_comm_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
) -> Work:
    """All-gather as a sum-all-reduce of a buffer zeroed except this rank's slot.

    Adding zeros is exact, except that a gathered ``-0.0`` arrives as ``+0.0``.
    """
    world, rank = _world_and_rank(group)
    n = input.numel()
    if output.numel() != n * world:
        raise ValueError(f"all_gather output has {output.numel()} elements, expected {n * world}")
    if output.dtype == torch.bool:
        return _DEFAULT.ds_comm_all_gather(output, input, group, async_op)
    wide = output.dtype in _WIDEN
    flat = torch.zeros(n * world, dtype=_WIDEN[output.dtype]) if wide else output.view(-1).zero_()
    flat[rank * n : (rank + 1) * n].copy_(input.reshape(-1))
    work = dist.all_reduce(flat, dist.ReduceOp.SUM, group=group, async_op=True)
    return _then(work, async_op, (lambda: output.view(-1).copy_(flat)) if wide else (lambda: None))


# --------------------------------------------------------------------------- ops


def _fused_adamw_check() -> tuple[bool, str]:
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False, f"torch {torch.__version__} has no fused AdamW"
    return True, "torch.optim.AdamW(fused=True) runs on cpu in this torch"


@hookimpl
def ds_op_providers() -> list[SimpleOpProvider]:
    return [
        SimpleOpProvider(
            "fused_adam", _fused_adamw_check, lambda: partial(torch.optim.AdamW, fused=True)
        )
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
