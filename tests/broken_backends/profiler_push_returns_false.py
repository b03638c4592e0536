"""Broken: range_push opens a range but returns False (the spec says True)."""

from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.errors import DSCoreError
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install

_open: list[str] = []


@hookimpl
def ds_profiler_range_push(msg: str) -> bool:
    _open.append(msg)
    return False


@hookimpl
def ds_profiler_range_pop() -> bool:
    if not _open:
        raise DSCoreError("range_pop() without a matching range_push()")
    _open.pop()
    return True
