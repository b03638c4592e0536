"""Host memory as a device: resident set, peak, and the process's own limits.

Every figure is in bytes. ``total`` and ``available`` honour the lowest of the process's
limits — ``RLIMIT_AS``, ``RLIMIT_DATA``, cgroup v2 ``memory.max``, cgroup v1
``memory.limit_in_bytes`` — so a job in a 4 GiB container is never told it has the host's 1 TiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from dataclasses import dataclass
from pathlib import Path

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# cgroup v1 reports "no limit" as a huge page-rounded number rather than "max".
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Limit:
    """One limit on the process: its bytes, how many of them are in use, and where it came from."""

    source: str
    limit: int
    used: int


def _status_kib(field: str, status: str | None = None) -> int:
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def resident_bytes() -> int:
    """Resident set size of this process."""
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * PAGE_SIZE


def peak_resident_bytes() -> int:
    """Peak resident set size (``VmHWM``) since start or the last :func:`reset_peak`."""
    return _status_kib("VmHWM")


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS through ``/proc/self/clear_refs``; False if forbidden."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_total() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def host_available(meminfo: str | None = None) -> int:
    """``MemAvailable`` from ``/proc/meminfo``: what new allocations can get without swapping."""
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_dirs(root: Path, proc_cgroup: str, controller: str | None) -> list[Path]:
    """Candidate directories of this process's cgroup: its own path first, then the mount root."""
    dirs = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if controller is None and hid == "0":
            dirs.append(root / path.lstrip("/"))
        elif controller is not None and controller in controllers.split(","):
            dirs.append(root / controller / path.lstrip("/"))
    dirs.append(root if controller is None else root / controller)
    return dirs


def cgroup_limits(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None
) -> list[Limit]:
    """The cgroup v2 and v1 memory limits on this process, if any."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    limits = []
    for d in _cgroup_dirs(root, proc_cgroup, None):
        limit = _read_int(d / "memory.max")
        if (d / "memory.max").exists():
            if limit is not None:
                used = _read_int(d / "memory.current") or 0
                limits.append(Limit("cgroup v2 memory.max", limit, used))
            break
    for d in _cgroup_dirs(root, proc_cgroup, "memory"):
        if (d / "memory.limit_in_bytes").exists():
            limit = _read_int(d / "memory.limit_in_bytes")
            if limit is not None and limit < _V1_UNLIMITED:
                used = _read_int(d / "memory.usage_in_bytes") or 0
                limits.append(Limit("cgroup v1 memory.limit_in_bytes", limit, used))
            break
    return limits


def rlimits(status: str | None = None) -> list[Limit]:
    """``RLIMIT_AS`` (against ``VmSize``) and ``RLIMIT_DATA`` (against ``VmData``) soft limits."""
    limits = []
    for name, field in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _hard = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            limits.append(Limit(name, soft, _status_kib(field, status)))
    return limits


def memory_info() -> tuple[int, int, Limit | None]:
    """(total, available, binding limit): capped by the lowest limit on this process."""
    total, available = host_total(), host_available()
    binding: Limit | None = None
    for lim in rlimits() + cgroup_limits():
        if lim.limit < total:
            total, binding = lim.limit, lim
        available = min(available, max(lim.limit - lim.used, 0))
    return total, min(available, total), binding


def trim() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``); False where unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    trim_fn = getattr(libc, "malloc_trim", None)
    if trim_fn is None:
        return False
    trim_fn(0)
    return True
