"""Broken: an asynchronous all-reduce hands back an already-"completed" handle."""

from typing import Any

import torch
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    COMPLETED,
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    Work,
)


@hookimpl
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    work = _cpu.ds_comm_all_reduce(tensor, op, group, async_op)
    return COMPLETED if async_op else work
