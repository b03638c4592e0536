"""Broken: a synchronous (host) stream says work is pending: ``query()`` is ``False`` though
everything queued on it finished when the call that queued it returned."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.backend_kit import HostStream
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class _Pending(HostStream):
    def query(self) -> bool:
        return False  # the bug


@hookimpl
def ds_stream_create(index: int | None, priority: int) -> HostStream:
    made = _cpu.ds_stream_create(index, priority)
    return _Pending(made.index, made.priority)
