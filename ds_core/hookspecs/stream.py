"""Streams (device work queues) and events (points in a stream).

Without the ``async_streams`` capability, streams are synchronous: work is complete when the
call that queued it returns, ``wait_*`` and ``synchronize`` return at once, and ``query`` is
``True``. Without ``device_timing``, events time with a monotonic host clock taken at
``record`` after synchronising the stream, so elapsed times are still real.

Ordering contract, shared with the collective hooks (see :mod:`ds_core.hookspecs.comm`):

- Work is ordered after earlier work on the same stream, never after other streams' work
  unless a ``Stream.wait_stream``/``Stream.wait_event`` call says so; ``wait_*`` orders
  later work on the waiting stream and does not block the host when ``async_streams`` is
  declared.
- ``ds_stream_use`` contexts nest: leaving one makes current again exactly the stream that
  was current when it was entered (also when the body raises), on the thread that entered.
- A collective runs after the stream current when it is called, and its handle's ``wait()``
  makes the stream current at the time of the wait wait for it (with ``async_streams``), or
  blocks the host until it completed (without). A tensor used by another stream than the one
  that produced it must stay alive and unmodified until that stream's use is ordered (by an
  event recorded after the use, waited for before the buffer is reused or freed).
- ``Stream.query()`` and ``Event.query()`` never block: they answer ``False`` while work
  queued before them has not run, and become ``True`` once it has, with no synchronising call
  needed; work they answered ``True`` for has completed, so its results are readable from any
  stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

from ds_core.hookspecs._contract import FACADE, HOT_PATH, MAY_CREATE_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import Event, Stream

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Streams (device work queues) and events (points in a stream).": "promises nothing: a summary of the section; its sentences below carry the promises",
    "Ordering contract, shared with the collective hooks": "promises nothing: a heading; the bullets under it carry the promises",
    "A tensor used by another stream than the one that produced it must stay alive": "promises nothing: an obligation of the caller, not of the backend",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked(
    ":param priority: vendor stream priority",
    "untestable because a priority changes only the order in which a device scheduler picks work, which no portable check observes",
)
def ds_stream_create(index: int | None, priority: int) -> Stream:
    """Create a new stream on a device.

    :param index: device index, or ``None`` for the current device.
    :param priority: vendor stream priority; 0 is the default, lower is higher priority.
    :returns: a stream object (see :class:`ds_core.types.Stream`) usable with ``ds_stream_use``.

    Device context: may create one.

    Use in backends: required. Facade: ``Stream(index=None, priority=0)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked("Hot path.", HOT_PATH)
def ds_stream_current(index: int | None) -> Stream:
    """Return the stream work is queued on now.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``current_stream(index=None)``. Hot path.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_stream_default(index: int | None) -> Stream:
    """Return the device's default stream.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``default_stream(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked("Hot path.", HOT_PATH)
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Return a context manager that makes ``stream`` current inside it and restores after.

    On exit (normal or by an exception) the stream current before entry is current again, so
    nested and consecutive uses compose; the context changes only the calling thread's stream.

    :param stream: a stream from ``ds_stream_create``/``ds_stream_current``/``ds_stream_default``.

    Device context: may create one.

    Use in backends: required. Facade: ``stream(s)``. Hot path.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_stream_event_create(enable_timing: bool) -> Event:
    """Create an event (see :class:`ds_core.types.Event`).

    ``elapsed_time(end)`` returns milliseconds, non-negative for an end recorded after the
    start; it raises ``RuntimeError`` when timing was not enabled or an event was not recorded.
    An event never recorded marks no work (as CUDA's): ``query()`` is ``True``, and
    ``synchronize()``, ``wait(stream)`` and ``Stream.wait_event`` on it return at once and
    order nothing.

    :param enable_timing: whether ``elapsed_time`` will be asked of this event.

    Device context: may create one.

    Use in backends: required. Facade: ``Event(enable_timing=False)``.
    """
