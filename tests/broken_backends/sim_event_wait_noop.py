"""Broken (sim, asynchronous): ``Event.wait(stream)`` orders nothing.

Events are sim events whose ``wait`` returns at once without making the stream wait, so work
queued on that stream may run before the recorded work (in ``DS_SIM_ASYNC=lazy`` mode it
always does). ``Stream.wait_event`` still works.
"""

from typing import Any

import torch
from ds_backend_sim import device
from ds_backend_sim.plugin import SimHooks
from sim_clone import export

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class _NoWaitEvent(torch.Event):
    def wait(self, stream: Any = None) -> None:
        return None  # the bug: the wait is dropped


class _Hooks(SimHooks):
    @hookimpl
    def ds_stream_event_create(self, enable_timing: bool) -> Any:
        device.init()
        ext = device.extension()
        event = _NoWaitEvent(device=device.DEVICE_TYPE, enable_timing=True)
        event.record(device.default_stream())  # as device.Event makes a sim event
        if not enable_timing:
            ext.mark_untimed(int(event.event_id))
        ext.mark_unrecorded(int(event.event_id))
        return event


export(_Hooks, globals())
