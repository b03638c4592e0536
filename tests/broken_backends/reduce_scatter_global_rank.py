"""Broken: reduce-scatter picks its chunk by global rank instead of rank in the group."""

from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    COMPLETED,
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    Work,
)


@hookimpl
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    from ds_core.comm import torch_reduce_op

    world, rank = dist.get_world_size(group), dist.get_rank() % dist.get_world_size(group)
    flat, n = input.reshape(-1), output.numel()
    dist.all_reduce(flat, dist.ReduceOp.SUM if op == "avg" else torch_reduce_op(op), group=group)
    output.view(-1).copy_(flat[rank * n : (rank + 1) * n])
    if op == "avg":
        output.div_(world)
    return COMPLETED
