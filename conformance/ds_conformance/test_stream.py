"""Streams and events: ordering across streams, event timing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier

pytestmark = tier("basic")


def _work(device: torch.device, n: int = 1 << 20) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float32, device=device)
    for _ in range(4):
        x = x * 1.0001 + 1
    return x


@hooks("ds_stream_create", "ds_stream_use", "ds_stream_current", "ds_stream_default")
@promise("ds_stream_create", "Create a new stream on a device.")
@promise("ds_stream_create", ":returns: a stream object")
@promise("ds_stream_current", "Return the stream work is queued on now.")
@promise("ds_stream_default", "Return the device's default stream.")
@promise(
    "ds_stream_use",
    "Return a context manager that makes ``stream`` current inside it and restores after.",
)
def test_work_on_a_side_stream_is_visible_after_wait_stream(acc: Any) -> None:
    default = acc.current_stream()
    check(
        default == acc.default_stream(),
        "current_stream()",
        default,
        "default_stream() outside any stream()",
        "ds_stream_current",
    )
    side = acc.Stream()
    src = torch.arange(1 << 20, dtype=torch.float32, device=acc.device())
    side.wait_stream(default)  # src was written on the default stream
    with acc.stream(side):
        check(
            acc.current_stream() == side,
            "current_stream() inside stream(side)",
            acc.current_stream(),
            "side",
            "ds_stream_use",
        )
        out = src * 3 + 2
    check(
        acc.current_stream() == default,
        "current_stream() after stream(side)",
        acc.current_stream(),
        "the previous stream",
        "ds_stream_use",
    )
    default.wait_stream(side)
    expected = torch.arange(1 << 20, dtype=torch.float32) * 3 + 2
    check(
        torch.equal(out.cpu(), expected),
        "side-stream result after wait_stream",
        "different",
        "src*3+2",
        "Stream.wait_stream",
    )


@hooks("ds_stream_create", "ds_stream_event_create", "ds_stream_use")
@promise("stream", "Work is ordered after earlier work on the same stream")
@promise("ds_stream_event_create", "Create an event (see")
def test_event_orders_work_between_streams(acc: Any) -> None:
    side = acc.Stream()
    side.wait_stream(acc.current_stream())
    event = acc.Event()
    with acc.stream(side):
        out = _work(acc.device())
        event.record(side)
    acc.current_stream().wait_event(event)
    result = (out * 2).cpu()
    event.synchronize()
    check(
        event.query() is True,
        "event.query() after synchronize()",
        event.query(),
        "True",
        "Event.synchronize",
    )
    expected = _work(torch.device("cpu")) * 2
    check(
        torch.allclose(result, expected, rtol=1e-5),
        "result after wait_event",
        "different",
        "the side stream's result",
        "Stream.wait_event",
    )


@hooks("ds_stream_event_create")
@promise("ds_stream_event_create", "``elapsed_time(end)`` returns milliseconds, non-negative")
def test_elapsed_time_is_non_negative_and_monotone(acc: Any) -> None:
    events = [acc.Event(enable_timing=True) for _ in range(3)]
    stream = acc.current_stream()
    events[0].record(stream)
    _work(acc.device())
    events[1].record(stream)
    _work(acc.device())
    events[2].record(stream)
    events[2].synchronize()
    t01 = events[0].elapsed_time(events[1])
    t02 = events[0].elapsed_time(events[2])
    check(t01 >= 0, "elapsed_time(e0, e1) ms", t01, "≥ 0", "Event.elapsed_time")
    check(
        t02 >= t01,
        "elapsed_time(e0, e2) ms",
        t02,
        f"≥ elapsed_time(e0, e1)={t01}",
        "Event.elapsed_time",
    )
    check(
        stream.query() is True,
        "stream.query() after the last event synchronised",
        stream.query(),
        "True",
        "Stream.query",
    )


@hooks("ds_stream_event_create")
@promise(
    "ds_stream_event_create",
    ":param enable_timing: whether ``elapsed_time`` will be asked of this event.",
)
def test_elapsed_time_without_timing_raises(acc: Any) -> None:
    a, b = acc.Event(enable_timing=False), acc.Event(enable_timing=False)
    a.record()
    b.record()
    b.synchronize()
    with pytest.raises(RuntimeError):
        a.elapsed_time(b)


@hooks("ds_stream_use", "ds_stream_current", "ds_stream_create")
@promise(
    "ds_stream_use",
    "On exit (normal or by an exception) the stream current before entry is current again",
)
@promise("stream", "``ds_stream_use`` contexts nest")
def test_stream_contexts_nest_and_restore_exactly_the_previous_stream(acc: Any) -> None:
    outer, inner, third = acc.Stream(), acc.Stream(), acc.Stream()
    start = acc.current_stream()

    def current_is(stream: Any, where: str) -> None:
        now = acc.current_stream()
        check(now == stream, f"current_stream() {where}", now, repr(stream), "ds_stream_use")

    with acc.stream(outer):
        current_is(outer, "inside stream(outer)")
        with acc.stream(inner):
            current_is(inner, "inside stream(outer) > stream(inner)")
            with acc.stream(outer):  # re-entering a stream already on the stack
                current_is(outer, "inside ... > stream(inner) > stream(outer)")
            current_is(inner, "after the innermost stream(outer)")
        current_is(outer, "after stream(inner), still inside stream(outer)")
        with acc.stream(third):  # a sequence of contexts at the same depth
            current_is(third, "inside stream(outer) > stream(third)")
        current_is(outer, "after stream(third)")
        with pytest.raises(KeyError), acc.stream(inner):
            raise KeyError("raised inside stream(inner)")
        current_is(outer, "after stream(inner) exited by an exception")
    current_is(start, "after every context")


@hooks("ds_stream_use", "ds_stream_current")
@promise("ds_stream_use", "the context changes only the calling thread's stream")
@promise("stream", "on the thread that entered")
def test_stream_context_changes_only_the_calling_thread(acc: Any) -> None:
    import threading

    side = acc.Stream()
    seen: list[Any] = []
    inside, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        acc.set_device(acc.current_device())  # device selection is per thread on some runtimes
        with acc.stream(side):
            inside.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        inside.wait(timeout=30)
        seen.append(acc.current_stream())
    finally:
        release.set()
        thread.join()
    check(
        seen[0] != side,
        "current_stream() on the main thread while another thread is inside stream(side)",
        seen[0],
        "not side (the context is per thread)",
        "ds_stream_use",
    )


@hooks("ds_stream_event_create")
@promise("stream", "Without ``device_timing``, events time with a monotonic host clock")
def test_elapsed_time_is_in_milliseconds_of_the_host_clock(acc: Any) -> None:
    """An idle gap of known host duration between two events: elapsed_time must be in ms."""
    import time

    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    stream = acc.current_stream()
    acc.synchronize()
    host_before = time.perf_counter()
    start.record(stream)
    time.sleep(0.05)
    host_gap_start = time.perf_counter()
    end.record(stream)
    end.synchronize()
    host_after = time.perf_counter()
    measured = start.elapsed_time(end)
    low = (host_gap_start - host_before) * 1000.0 * 0.5  # the device saw at least the sleep
    high = (host_after - host_before) * 1000.0 * 1.5 + 5.0  # and at most the whole bracket
    check(
        low <= measured <= high,
        "elapsed_time over a 50 ms host sleep",
        measured,
        f"in [{low:.1f}, {high:.1f}] milliseconds (host clock)",
        "Event.elapsed_time",
    )
