"""A torch-style device module for the host: the CPU seen through the shape vendors' modules have.

:class:`HostDevice` answers the calls :class:`~ds_core.backend_kit.TorchStyleHooks` makes of a
``torch.<type>`` module (``device_count``, ``current_device``, ``Stream``, ``Event``,
``memory_allocated``, ``mem_get_info``, ...) for the host, so a ``TorchStyleHooks`` backend runs
on any machine: the scaffold's generated backend for ``--device-type cpu`` uses it until the
vendor points the hooks at its own module, and ``bench/dispatch.py`` measures dispatch through
it. Ranks are processes (``LOCAL_WORLD_SIZE`` devices, current = the last ``set_device``, else
``LOCAL_RANK``); streams and events are the kit's host ones (:class:`HostStreams`); memory is the
process's resident set (bytes). The CPU backend's device, RNG and memory hooks are this class;
what it adds is its own (the process's memory limits, the CPU's name).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from typing import Any

import torch

from ds_core.backend_kit.host_streams import HostEvent, HostStream, HostStreams

__all__ = ["HostDevice", "HostDeviceProperties", "status_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class HostDeviceProperties:
    """What ``get_device_properties`` answers: a name and the physical memory in bytes."""

    name: str
    total_memory: int


def status_bytes(field: str, status: str | None = None) -> int:
    """A kB field of ``/proc/self/status`` (or of ``status``, its text) in bytes."""
    if status is None:
        with open("/proc/self/status") as f:
            status = f.read()
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


class HostDevice:
    """The host as a torch-style device module (see the module docstring).

    Device arguments (``"cpu"``, ``"cpu:1"``, an int or ``None``) are accepted and ignored
    where the host has one answer for every device: one generator, one resident set.
    """

    def __init__(self) -> None:
        self._current: int | None = None
        self._streams = HostStreams(self.current_device)
        self.default_generators = (torch.default_generator,)

    # -- device ----------------------------------------------------------------------------

    def device_count(self) -> int:
        """``LOCAL_WORLD_SIZE`` (ranks are processes), at least 1."""
        return max(int(os.environ.get("LOCAL_WORLD_SIZE") or 1), 1)

    def current_device(self) -> int:
        """The last :meth:`set_device`, else ``LOCAL_RANK`` (read once: a hot path), else 0."""
        current = self._current
        if current is None:
            current = self._current = int(os.environ.get("LOCAL_RANK") or 0)
        return current

    def set_device(self, index: int) -> None:
        """Make ``index`` current (the caller has checked the range)."""
        self._current = index

    def synchronize(self, device: Any = None) -> None:
        """Nothing to wait for: host work is complete when the call that queued it returns."""
        return None

    def get_device_properties(self, device: Any = None) -> HostDeviceProperties:
        """The machine's name and physical memory (bytes)."""
        total = _PAGE * os.sysconf("SC_PHYS_PAGES")
        return HostDeviceProperties(platform.machine() or "host", total)

    # -- rng -------------------------------------------------------------------------------
    # The host has one generator; every device index shares it.

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    # -- streams and events ----------------------------------------------------------------

    def Stream(self, device: Any = None, priority: int = 0) -> HostStream:  # noqa: N802
        """A new host stream on the current device."""
        return self._streams.create(None, priority)

    def current_stream(self, device: Any = None) -> HostStream:
        return self._streams.current()

    def default_stream(self, device: Any = None) -> HostStream:
        return self._streams.default

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._streams.use(stream)

    def Event(self, enable_timing: bool = False) -> HostEvent:  # noqa: N802
        return HostEvent(enable_timing)

    # -- memory (bytes) ----------------------------------------------------------------------

    def memory_allocated(self, device: Any = None) -> int:
        """The resident set size."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE

    def max_memory_allocated(self, device: Any = None) -> int:
        """The resident set's high-water mark (``VmHWM``)."""
        return max(status_bytes("VmHWM"), self.memory_allocated())

    def reset_peak_memory_stats(self, device: Any = None) -> bool:
        """Reset ``VmHWM`` to the current resident set; ``False`` where the kernel forbids it."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def memory_reserved(self, device: Any = None) -> int:
        """The resident set size: the host allocator keeps nothing it does not use."""
        return self.memory_allocated()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        current = self.memory_allocated()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": max(self.max_memory_allocated(), current),
            "reserved_bytes.all.current": current,
        }

    def empty_cache(self) -> None:
        """Return freed heap memory to the OS (glibc's ``malloc_trim``; nothing elsewhere):
        freed blocks the allocator keeps would otherwise serve the next allocation without
        the resident set moving, so ``memory_allocated`` would miss it."""
        _malloc_trim()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """``(available, total)`` physical memory in bytes."""
        total = _PAGE * os.sysconf("SC_PHYS_PAGES")
        return min(_PAGE * os.sysconf("SC_AVPHYS_PAGES"), total), total


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
