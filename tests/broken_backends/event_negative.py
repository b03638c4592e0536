"""Broken: events report negative elapsed time (start and end swapped)."""

from typing import Any

from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from ds_backend_cpu.plugin import HostEvent

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class SwappedEvent(HostEvent):
    __slots__ = ()

    def elapsed_time(self, end_event: Any) -> float:
        return -abs(super().elapsed_time(end_event)) - 1.0


@hookimpl
def ds_stream_event_create(enable_timing: bool) -> HostEvent:
    return SwappedEvent(enable_timing)
