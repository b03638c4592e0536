"""Broken: bfloat16 collectives travel as float16 (same width, different range)."""

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
    if tensor.dtype != torch.bfloat16:
        return _cpu.ds_comm_all_reduce(tensor, op, group, async_op)
    half = tensor.to(torch.float16)
    work = _cpu.ds_comm_all_reduce(half, op, group, False)
    tensor.copy_(half)
    return work
