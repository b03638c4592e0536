"""Broken: float64 all-reduces travel as float32 (a "fast path" that narrows the wire type)."""

from typing import Any

import torch
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    Work,
)


@hookimpl
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    if tensor.dtype != torch.float64:
        return _cpu.ds_comm_all_reduce(tensor, op, group, async_op)
    narrow = tensor.to(torch.float32)
    work = _cpu.ds_comm_all_reduce(narrow, op, group, False)
    tensor.copy_(narrow)
    return work
