"""Broken: leaving a stream context makes the default stream current, not the previous one."""

import contextlib
from collections.abc import Iterator
from typing import Any

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@contextlib.contextmanager
def _use(stream: Any) -> Iterator[Any]:
    stack = _cpu._local.__dict__.setdefault("stack", [])
    stack.append(stream)
    try:
        yield stream
    finally:
        stack.clear()


@hookimpl
def ds_stream_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return _use(stream)
