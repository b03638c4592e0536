"""Streams and events for devices whose work is synchronous with the host, and host timing.

A synchronous device (the CPU, or any backend without ``async_streams``) still implements the
stream hooks: its streams order nothing because every piece of work is finished when the call
that queued it returns. :class:`HostStreams` holds one device's streams (a default stream and a
per-thread stack of the streams made current with :meth:`HostStreams.use`) and answers the five
stream hooks; :class:`HostEvent` records a host clock reading. :class:`HostTimedEvent` is for
asynchronous vendors whose device timing is a stub: it synchronises on record and reads the
host clock. Times are in milliseconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HostEvent", "HostStream", "HostStreams", "HostTimedEvent"]


class HostEvent:
    """An event on a synchronous device: recorded at a host clock reading.

    :param enable_timing: whether :meth:`elapsed_time` may be asked of this event.
    """

    __slots__ = ("_t", "enable_timing")

    def __init__(self, enable_timing: bool) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        """Take the host time (work queued before it is already complete)."""
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: work before the record is already complete."""
        return None

    def synchronize(self) -> None:
        """Nothing to wait for: work before the record is already complete."""
        return None

    def query(self) -> bool:
        """Always ``True``: the event's work is complete."""
        return True

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s.

        :raises RuntimeError: when timing was not enabled on both, or either is unrecorded.
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._t is None or end_event._t is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end_event._t - self._t) * 1000.0


class HostStream:
    """A work queue on a synchronous device: every wait is already satisfied.

    :param index: the device index the stream belongs to.
    :param priority: the priority it was created with (kept, since nothing is reordered).
    """

    __slots__ = ("index", "priority")

    def __init__(self, index: int = 0, priority: int = 0) -> None:
        self.index, self.priority = index, priority

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for: the other stream's work is complete."""
        return None

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: the event's work is complete."""
        return None

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        """Record ``event`` (a new untimed one when ``None``) on this stream and return it."""
        event = event if event is not None else HostEvent(enable_timing=False)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Nothing to wait for: the stream's work is complete."""
        return None

    def query(self) -> bool:
        """Always ``True``: the stream's work is complete."""
        return True

    def __repr__(self) -> str:
        return f"HostStream(index={self.index}, priority={self.priority})"


class HostStreams:
    """The stream hooks' bodies for a synchronous device.

    The current stream is per thread, as on devices with real streams: a stream made current
    by :meth:`use` in one thread is not current in another.

    :param current_index: returns the current device index (new streams belong to it).
    """

    def __init__(self, current_index: Callable[[], int]) -> None:
        self._current_index = current_index
        self.default = HostStream(0, 0)
        self._local = threading.local()

    def create(self, index: int | None, priority: int) -> HostStream:
        """A new stream on device ``index`` (the current device when ``None``)."""
        return HostStream(self._current_index() if index is None else index, priority)

    def current(self, index: int | None = None) -> HostStream:
        """The innermost stream made current in this thread, else the default stream."""
        stack: list[HostStream] | None = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.default

    def default_stream(self, index: int | None = None) -> HostStream:
        """The device's default stream."""
        return self.default

    @contextlib.contextmanager
    def _use(self, stream: HostStream) -> Iterator[HostStream]:
        stack: list[HostStream] = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager making ``stream`` current in this thread inside it."""
        return self._use(stream)

    @staticmethod
    def event(enable_timing: bool) -> HostEvent:
        """A new host event."""
        return HostEvent(enable_timing)


class HostTimedEvent:
    """A vendor event whose timing comes from the host clock.

    For vendors whose device events are stubs (``elapsed_time`` returns 0.0), ``record`` queues
    the vendor event, then synchronises the recording stream and reads ``time.perf_counter``, so
    the reading falls after all work queued before it. Synchronising on every record also keeps
    ``wait`` correct even where the vendor's event wait is itself a stub: the work it would
    wait for is already complete. The cost is that recording blocks the host.

    :param event: the vendor event.
    :param enable_timing: whether ``elapsed_time`` may be asked of this event.
    :param current_stream: returns the stream to synchronise when ``record`` gets none
        (called with ``None``, the current device).
    """

    __slots__ = ("_current_stream", "_t", "enable_timing", "event")

    def __init__(
        self, event: Any, enable_timing: bool, current_stream: Callable[[int | None], Any]
    ) -> None:
        self.event = event
        self.enable_timing = enable_timing
        self._current_stream = current_stream
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        """Queue the vendor event on ``stream`` (the current one when ``None``), wait for it,
        and take the host time."""
        target = stream if stream is not None else self._current_stream(None)
        self.event.record(target)
        target.synchronize()
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for the event (already satisfied once recorded)."""
        self.event.wait(stream)

    def synchronize(self) -> None:
        """Block until the event's work is done (already done once recorded)."""
        self.event.synchronize()

    def query(self) -> bool:
        """Whether the event's work is done: true once recorded, by construction."""
        return self._t is not None or bool(self.event.query())

    def elapsed_time(self, end_event: HostTimedEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s, on the host clock.

        :raises RuntimeError: when timing was not enabled on both, or either is unrecorded.
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._t is None or end_event._t is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end_event._t - self._t) * 1000.0
