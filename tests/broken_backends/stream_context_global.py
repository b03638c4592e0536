"""Broken: the current stream is process-wide, so one thread's context changes every thread's."""

import contextlib
from collections.abc import Iterator
from typing import Any

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install

_stack: list[Any] = []  # the bug: one stack for the process, not one per thread


@contextlib.contextmanager
def _use(stream: Any) -> Iterator[Any]:
    _stack.append(stream)
    try:
        yield stream
    finally:
        _stack.pop()


@hookimpl
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return _use(stream)


@hookimpl
def ds_stream_current(index: int | None) -> Any:
    return _stack[-1] if _stack else _cpu.ds_stream_default(index)
