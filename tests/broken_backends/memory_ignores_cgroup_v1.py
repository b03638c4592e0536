"""Broken: memory_info honours the rlimits and cgroup v2 but ignores a cgroup v1 limit."""

from ds_backend_cpu import memory
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    MemoryInfo,
)


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
    total, available = memory.host_total(), memory.host_available()
    binding = None
    for lim in memory.rlimits() + memory.cgroup_limits():
        if lim.source.startswith("cgroup v1"):
            continue
        if lim.limit < total:
            total, binding = lim.limit, lim
        available = min(available, max(lim.limit - lim.used, 0))
    return MemoryInfo(
        total=total,
        available=min(available, total),
        limit=binding.limit if binding else None,
        limit_source=binding.source if binding else "",
    )
