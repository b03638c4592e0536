"""Broken: memory_allocated reports the same number whatever is allocated."""

from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_memory_allocated(index: int | None) -> int:
    return 1 << 30
