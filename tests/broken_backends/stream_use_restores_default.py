"""Broken: leaving a stream context makes the default stream current, not the previous one."""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install

_local = threading.local()


@contextlib.contextmanager
def _use(stream: Any) -> Iterator[Any]:
    _local.current = stream
    try:
        yield stream
    finally:
        _local.current = None  # the bug: "back to the default" instead of the previous stream


@hookimpl
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return _use(stream)


@hookimpl
def ds_stream_current(index: int | None) -> Any:
    current = getattr(_local, "current", None)
    return current if current is not None else _cpu.ds_stream_default(index)
