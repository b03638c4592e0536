"""Broken: a receive whose peer has exited waits forever. Its ``wait()`` takes the library's
error for a transient one and posts the receive again, and again (a "retry on a dropped
connection" that never gives up), so a dead peer is a hang, not an error."""

import time
from typing import Any

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class _RetryingWork:
    def __init__(self, post: Any) -> None:
        self._post = post
        self._work = post()

    def wait(self) -> bool:
        while True:
            try:
                return bool(self._work.wait())
            except RuntimeError:
                time.sleep(0.5)  # the bug: the peer is gone for good, not briefly
                try:
                    self._work = self._post()
                except RuntimeError:
                    pass


@hookimpl
def ds_comm_recv(tensor: Any, src: int, group: Any, tag: int, async_op: bool) -> Any:
    work = _RetryingWork(lambda: _cpu.ds_comm_recv(tensor, src, group, tag, True))
    if not async_op:
        work.wait()
    return work
