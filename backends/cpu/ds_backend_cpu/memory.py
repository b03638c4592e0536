"""The process's own memory limits, which the CPU backend adds to the kit's host device.

The resident set, its peak and ``malloc_trim`` are :class:`ds_core.backend_kit.HostDevice`'s.
Every figure is in bytes. ``total`` and ``available`` honour the lowest of the process's
limits — ``RLIMIT_AS``, ``RLIMIT_DATA``, cgroup v2 ``memory.max``, cgroup v1
``memory.limit_in_bytes`` — so a job in a 4 GiB container is never told it has the host's 1 TiB.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ds_core.backend_kit.host_device import status_bytes

# cgroup v1 reports "no limit" as a huge page-rounded number rather than "max".
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Limit:
    """One limit on the process: its bytes, how many of them are in use, and where it came from."""

    source: str
    limit: int
    used: int


def host_total() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def host_available(meminfo: str | None = None) -> int:
    """``MemAvailable`` from ``/proc/meminfo``: what new allocations can get without swapping.

    :raises RuntimeError: the text has no ``MemAvailable`` line (Linux before 3.14, of 2014;
        enterprise 3.10 kernels have it backported).
    """
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # the kernel writes kB: KiB
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def _read_int(path: Path) -> int | None:
    """The integer in ``path``; ``None`` when it is missing or says something else (``max``)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _cgroup_dirs(root: Path, proc_cgroup: str, controller: str | None) -> list[Path]:
    """Candidate directories of this process's cgroup: its own path first, then the mount root.

    ``/proc/self/cgroup`` lines are ``id:controllers:path``; the path may itself hold colons
    (containerd's ``...slice:cri-containerd:<id>``).
    """
    dirs = []
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
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
            limits.append(Limit(name, soft, status_bytes(field, status)))
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
