"""Broken: elapsed_time returns seconds where the contract says milliseconds."""

from typing import Any

from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from ds_backend_cpu.plugin import HostEvent

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class SecondsEvent(HostEvent):
    __slots__ = ()

    def elapsed_time(self, end_event: Any) -> float:
        return super().elapsed_time(end_event) / 1000.0


@hookimpl
def ds_stream_event_create(enable_timing: bool) -> HostEvent:
    return SecondsEvent(enable_timing)
