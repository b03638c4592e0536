"""Broken: stream creation takes any priority, a string or None included (a host stream keeps
it unused, so nothing downstream notices)."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.backend_kit import HostStream
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_stream_create(index: int | None, priority: int) -> HostStream:
    return _cpu.ds_stream_create(index, 0)
