"""Broken: memory_info reports KiB where the contract says bytes (the /proc figure, unscaled)."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    MemoryInfo,
)


@hookimpl
def ds_memory_info(index: int | None) -> MemoryInfo:
    info = _cpu.ds_memory_info(index)
    return MemoryInfo(
        total=info.total // 1024,
        available=info.available // 1024,
        limit=None if info.limit is None else info.limit // 1024,
        limit_source=info.limit_source,
    )
