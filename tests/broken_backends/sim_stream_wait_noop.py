"""Broken (sim, asynchronous): ``Stream.wait_stream`` and ``Stream.wait_event`` order nothing.

Every stream the backend hands out is a ``torch.Stream`` whose waits return at once without
queueing the wait, so work on the waiting stream may run before the work it waited for (in
``DS_SIM_ASYNC=lazy`` mode it always does: the other stream's queued copy has not run).
"""

from typing import Any

import torch
from ds_backend_sim.plugin import SimHooks
from sim_clone import export

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class _NoWaitStream(torch.Stream):
    def wait_stream(self, stream: Any) -> None:
        return None  # the bug: the wait is dropped

    def wait_event(self, event: Any) -> None:
        return None


def _broken(stream: torch.Stream) -> torch.Stream:
    return _NoWaitStream(
        stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
    )


class _Hooks(SimHooks):
    @hookimpl
    def ds_stream_create(self, index: int | None, priority: int) -> Any:
        return _broken(super().ds_stream_create(index, priority))

    @hookimpl
    def ds_stream_current(self, index: int | None) -> Any:
        return _broken(super().ds_stream_current(index))

    @hookimpl
    def ds_stream_default(self, index: int | None) -> Any:
        return _broken(super().ds_stream_default(index))


export(_Hooks, globals())
