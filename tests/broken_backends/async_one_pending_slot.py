"""Broken: an asynchronous all-reduce is deferred to its wait() through one pending slot per
process, so a second collective issued before the first is waited for replaces it: with two
groups in flight, the first group's wait() reduces nothing."""

from typing import Any

import torch
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    Work,
)

_slot: list[tuple[torch.Tensor, str, Any]] = []  # the bug: one slot, not one per handle


class _Deferred:
    def wait(self) -> bool:
        if _slot:
            tensor, op, group = _slot.pop()
            _cpu.ds_comm_all_reduce(tensor, op, group, False)
        return True


@hookimpl
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    if not async_op:
        return _cpu.ds_comm_all_reduce(tensor, op, group, False)
    _slot[:] = [(tensor, op, group)]
    return _Deferred()
