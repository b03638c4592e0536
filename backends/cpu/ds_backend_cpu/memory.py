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


#: (source, controller folder, limit file, usage file) of cgroup v2 and v1
_HIERARCHIES = (
    ("cgroup v2 memory.max", "", "memory.max", "memory.current"),
    ("cgroup v1 memory.limit_in_bytes", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
)


def _cgroup_dirs(root: Path, proc_cgroup: str, controller: str) -> list[Path]:
    """The folders whose limits bind this process in one hierarchy (v2: ``controller`` "").

    Its own cgroup and every ancestor up to the mount's root: a parent's limit binds its
    children too, and a container that mounts its own cgroup as the root sees a path in
    ``/proc/self/cgroup`` that does not exist under the mount. Lines are
    ``id:controllers:path``; the path may itself hold colons (containerd's
    ``...slice:cri-containerd:<id>``).
    """
    base = root / controller
    dirs = dict.fromkeys([base])
    for line in proc_cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        mine = controller in controllers.split(",") if controller else hid == "0"
        if mine:
            own = base / path.lstrip("/")
            dirs.update(dict.fromkeys(d for d in (own, *own.parents) if d.is_relative_to(base)))
    return list(dirs)


def cgroup_limits(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None
) -> list[Limit]:
    """The cgroup v2 and v1 memory limits on this process, one per limited folder."""
    # cgroup v1's "unlimited" (2^63 rounded down to a page) is kept as a limit: above any
    # host's memory, it never binds.
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    limits = []
    for source, controller, limit_file, usage_file in _HIERARCHIES:
        for d in _cgroup_dirs(root, proc_cgroup, controller):
            limit = _read_int(d / limit_file)
            if limit is not None:
                limits.append(Limit(source, limit, _read_int(d / usage_file) or 0))
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
