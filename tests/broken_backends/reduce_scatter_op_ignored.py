"""Broken: reduce-scatter always sums, whatever op it is asked for."""

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
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    return _cpu.ds_comm_reduce_scatter(
        output, input, "avg" if op == "avg" else "sum", group, async_op
    )
