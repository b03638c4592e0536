"""Streams (device work queues) and events (points in a stream).

Without the ``async_streams`` capability, streams are synchronous: work is complete when the
call that queued it returns, ``wait_*`` and ``synchronize`` return at once, and ``query`` is
``True``. Without ``device_timing``, events time with a monotonic host clock taken at
``record`` after synchronising the stream, so elapsed times are still real.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ds_core.hookspecs._markers import hookspec
from ds_core.types import Event, Stream


@hookspec(firstresult=True)
def ds_stream_create(index: int | None, priority: int) -> Stream:
    """Create a new stream on a device.

    :param index: device index, or ``None`` for the current device.
    :param priority: vendor stream priority; 0 is the default, lower is higher priority.
    :returns: a stream object (see :class:`ds_core.types.Stream`) usable with ``ds_stream_use``.

    Device context: may create one.

    Use in backends: required. Facade: ``Stream(index=None, priority=0)``.
    """


@hookspec(firstresult=True)
def ds_stream_current(index: int | None) -> Stream:
    """Return the stream work is queued on now.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``current_stream(index=None)``. Hot path.
    """


@hookspec(firstresult=True)
def ds_stream_default(index: int | None) -> Stream:
    """Return the device's default stream.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``default_stream(index=None)``.
    """


@hookspec(firstresult=True)
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Return a context manager that makes ``stream`` current inside it and restores after.

    :param stream: a stream from ``ds_stream_create``/``ds_stream_current``/``ds_stream_default``.

    Device context: may create one.

    Use in backends: required. Facade: ``stream(s)``. Hot path.
    """


@hookspec(firstresult=True)
def ds_stream_event_create(enable_timing: bool) -> Event:
    """Create an event (see :class:`ds_core.types.Event`).

    ``elapsed_time(end)`` returns milliseconds, non-negative for an end recorded after the
    start; it raises ``RuntimeError`` when timing was not enabled or an event was not recorded.

    :param enable_timing: whether ``elapsed_time`` will be asked of this event.

    Device context: may create one.

    Use in backends: required. Facade: ``Event(enable_timing=False)``.
    """
