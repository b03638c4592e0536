"""Broken: memory_info honours the rlimits and cgroup v2 but ignores a cgroup v1 limit."""

from ds_backend_cpu import memory
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from honoured_limits import memory_info_of

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    MemoryInfo,
)


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
    limits = memory.rlimits() + memory.cgroup_limits()
    return memory_info_of([lim for lim in limits if not lim.source.startswith("cgroup v1")])
