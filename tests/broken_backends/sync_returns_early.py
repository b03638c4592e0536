"""Broken: a synchronous all-reduce returns before the collective completed."""

from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.comm import torch_reduce_op
from ds_core.types import (
    COMPLETED,
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    Work,
)


@hookimpl
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    if async_op or op == "avg" or tensor.dtype == torch.int16:
        return _cpu.ds_comm_all_reduce(tensor, op, group, async_op)
    dist.all_reduce(tensor, torch_reduce_op(op), group=group, async_op=True)  # handle dropped
    return COMPLETED
