"""Broken: memory_info reads the limit of the process's own cgroup folder only, so a limit on
a parent (a Kubernetes pod's, over a container with none of its own) is ignored."""

from pathlib import Path

from ds_backend_cpu import memory
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from honoured_limits import memory_info_of

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    MemoryInfo,
)


def _own_folder_limits() -> list[memory.Limit]:
    proc = Path("/proc/self/cgroup").read_text()
    limits = []
    for source, controller, limit_file, usage_file in memory._HIERARCHIES:
        # the mount's root, then the process's own folder, then its ancestors
        dirs = memory._cgroup_dirs(Path("/sys/fs/cgroup"), proc, controller)
        own = dirs[1] if len(dirs) > 1 else dirs[0]
        limit = memory._read_int(own / limit_file)
        if limit is not None:
            limits.append(memory.Limit(source, limit, memory._read_int(own / usage_file) or 0))
    return limits


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
    return memory_info_of(memory.rlimits() + _own_folder_limits())
