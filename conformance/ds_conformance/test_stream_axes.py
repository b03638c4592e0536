"""Stream and event edge axes (issue 28 §2): waits that order queued work, non-default
streams, other threads, unrecorded events in every event method, polling without a sync.

Every ordering check here reads a buffer filled by a copy queued on another stream
(:func:`ds_conformance.axes.queue_copy`): on an asynchronous device whose wait orders nothing,
the reader sees the buffer before the copy ran (on the simulated accelerator in ``lazy`` mode,
every time). On a device with synchronous streams the checks pass trivially, as the contract
says they may.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from ds_conformance import axes
from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier
from ds_core.types import Event

CATEGORY = "stream"
pytestmark = tier("basic")

#: How the consumer stream is made to wait for the producer's copy.
WAITS: tuple[str, ...] = ("Stream.wait_stream", "Stream.wait_event", "Event.wait")
#: Seconds a poll may take before the check gives up: a liveness bound, not a timing claim.
POLL_LIMIT_S = 60.0

ORDERS = "``wait_*`` orders later work on the waiting stream"
UNRECORDED = "An event never recorded marks no work (as CUDA's)"
POLLS = "``Stream.query()`` and ``Event.query()`` never block"


def _order(acc: Any, how: str, consumer: Any, producer: Any) -> None:
    """Make ``consumer`` wait for the work queued on ``producer`` so far, by ``how``."""
    if how == "Stream.wait_stream":
        consumer.wait_stream(producer)
        return
    event = acc.Event()
    event.record(producer)
    if how == "Stream.wait_event":
        consumer.wait_event(event)
    else:
        event.wait(consumer)


@pytest.mark.parametrize("how", WAITS)
@pytest.mark.parametrize("consumer_kind", ["created", "default"])
@promise("stream", ORDERS)
@promise("ds_stream_use", ":param stream: a stream from ``ds_stream_create``")
@hooks("ds_stream_create", "ds_stream_default", "ds_stream_use", "ds_stream_event_create")
def test_a_wait_orders_work_queued_on_another_stream(
    acc: Any, how: str, consumer_kind: str
) -> None:
    producer = acc.Stream()
    consumer = acc.Stream() if consumer_kind == "created" else acc.default_stream()
    src = axes.source(acc, salt=3.0)
    dst = axes.queue_copy(acc, producer, src)
    _order(acc, how, consumer, producer)
    with acc.stream(consumer):
        got = dst * 2  # ordered after the copy only by the wait
    acc.synchronize()
    diff = axes.first_difference(got, axes.expected(3.0) * 2)
    check(
        diff == "equal",
        f"work on the {consumer_kind} stream after {how} on a stream with a queued copy",
        diff,
        "equal to the copy's values × 2",
        how,
    )


@pytest.mark.parametrize("how", WAITS)
@promise("stream", ORDERS)
@hooks("ds_stream_create", "ds_stream_use", "ds_stream_current", "ds_stream_event_create")
def test_work_queued_by_another_thread_is_ordered_by_a_wait_on_this_one(acc: Any, how: str) -> None:
    producer = acc.Stream()
    src = axes.source(acc, salt=5.0)
    made: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            acc.set_device(src.device.index if src.device.index is not None else 0)
            made.append(axes.queue_copy(acc, producer, src))
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    current = acc.current_stream()
    _order(acc, how, current, producer)
    got = made[0] * 2
    acc.synchronize()
    diff = axes.first_difference(got, axes.expected(5.0) * 2)
    check(
        diff == "equal",
        f"work on this thread's stream after {how} on a copy another thread queued",
        diff,
        "equal to the copy's values × 2",
        how,
    )


#: The Event protocol's methods that take an event as it is, derived from the type.
EVENT_METHODS: tuple[str, ...] = tuple(
    name for name in vars(Event) if not name.startswith("_") and name != "record"
)


@pytest.mark.parametrize("timing", [False, True], ids=["untimed", "timed"])
@pytest.mark.parametrize("method", [*EVENT_METHODS, "Stream.wait_event"])
@promise("ds_stream_event_create", UNRECORDED)
@promise("ds_stream_event_create", "it raises ``RuntimeError`` when timing was not enabled")
@hooks("ds_stream_event_create", "ds_stream_current")
def test_an_unrecorded_event_marks_no_work_in_every_method(
    acc: Any, method: str, timing: bool
) -> None:
    event = acc.Event(enable_timing=timing)
    stream = acc.current_stream()
    if method == "elapsed_time":
        other = acc.Event(enable_timing=timing)
        other.record(stream)
        other.synchronize()
        for start, end in ((event, other), (other, event)):
            with pytest.raises(RuntimeError):
                start.elapsed_time(end)  # the spec's error, whichever end is unrecorded
        return
    if method == "query":
        answer = event.query()
        check(answer is True, "an unrecorded event's query()", answer, "True", "Event.query")
        return
    # synchronize / wait / Stream.wait_event: return at once and order nothing, so work queued
    # after them on this stream runs as if they had not been called.
    src = axes.source(acc, salt=7.0)
    if method == "synchronize":
        event.synchronize()
    elif method == "wait":
        event.wait(stream)
    else:
        stream.wait_event(event)
    got = src * 2
    acc.synchronize()
    diff = axes.first_difference(got, axes.expected(7.0) * 2)
    check(diff == "equal", f"work after {method} on an unrecorded event", diff, "equal", method)


@pytest.mark.parametrize("what", ["Event.query", "Stream.query"])
@promise("stream", POLLS)
@hooks("ds_stream_create", "ds_stream_event_create", "ds_stream_use")
def test_polling_query_sees_queued_work_complete_without_a_sync(acc: Any, what: str) -> None:
    producer = acc.Stream()
    src = axes.source(acc, salt=9.0)
    dst = axes.queue_copy(acc, producer, src)
    event = acc.Event()
    event.record(producer)
    poll = event.query if what == "Event.query" else producer.query
    answers: list[Any] = []
    deadline = time.monotonic() + POLL_LIMIT_S
    while True:  # nothing but the query: no synchronize, no wait, no blocking copy
        answer = poll()
        answers.append(answer)
        if answer is not False or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    check(
        answers[-1] is True and all(isinstance(a, bool) for a in answers),
        f"{what}() polled for up to {POLL_LIMIT_S:.0f} s after a queued copy",
        answers[-5:],
        "bools ending in True (the work completes without a synchronising call)",
        what,
    )
    # True means the copy completed: its result is readable from another stream, no wait.
    with acc.stream(acc.Stream()):
        got = dst * 2
    acc.synchronize()
    diff = axes.first_difference(got, axes.expected(9.0) * 2)
    check(diff == "equal", f"a buffer {what}() answered True for", diff, "equal", what)


#: Priorities past any device's range at both ends (CUDA's is a few levels below 0).
PRIORITIES: tuple[int, ...] = (0, -1, 1, -100, 100)


@promise("hookspecs", axes.PRIORITY_RULE)
@hooks("ds_stream_create", "ds_stream_use")
def test_a_priority_in_and_past_any_range_and_of_the_wrong_type(acc: Any) -> None:
    axes.skip_before_ranges(acc)
    src = axes.source(acc, salt=5.0)
    for priority in PRIORITIES:
        stream = acc._h.ds_stream_create(None, priority)
        dst = axes.queue_copy(acc, stream, src)
        stream.synchronize()
        diff = axes.first_difference(dst, axes.expected(5.0))
        check(diff == "equal", f"a copy on Stream(priority={priority}) after its synchronize()",
              diff, "equal", "ds_stream_create")  # fmt: skip
    for wrong in (*axes.NOT_INTS, None):
        with pytest.raises(TypeError):
            acc._h.ds_stream_create(None, wrong)


@hooks("ds_stream_create", "ds_stream_use", "ds_stream_event_create")
@promise("stream", "Without the ``async_streams`` capability, streams are synchronous")
def test_without_async_streams_work_is_complete_when_queued(acc: Any) -> None:
    if "async_streams" in acc.capabilities:
        pytest.skip("the backend declares async_streams: its streams may run behind the host")
    src = axes.source(acc, salt=7.0)
    stream, other = acc.Stream(), acc.Stream()
    dst = axes.queue_copy(acc, stream, src)
    # Read before any wait or synchronize: the copy finished when the call that queued it did.
    diff = axes.first_difference(dst, axes.expected(7.0))
    check(diff == "equal", "a copy queued on a stream, read at once", diff, "equal",
          "ds_stream_create")  # fmt: skip
    event = acc.Event()
    event.record(stream)
    for what, value in (("Stream.query()", stream.query()), ("Event.query()", event.query())):
        check(value is True, what, value, "True (nothing is pending)", "ds_stream_event_create")
    other.wait_stream(stream)
    other.wait_event(event)
    stream.synchronize()
    event.synchronize()
