"""Broken: reduce-scatter picks its chunk by global rank instead of rank in the group."""

from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.comm import torch_reduce_op
from ds_core.types import BackendInfo, Work  # noqa: F401 - BackendInfo: identity


@hookimpl
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    """The CPU backend's reduce-scatter with ``dist.get_rank()`` where it needs the group's."""
    world, rank = dist.get_world_size(group), dist.get_rank() % dist.get_world_size(group)
    flat, n = _cpu._wide(input).view(-1), output.numel()

    def finish() -> None:
        output.view(-1).copy_(flat[rank * n : (rank + 1) * n])
        if op == "avg":
            output.div_(world)

    torch_op = dist.ReduceOp.SUM if op == "avg" else torch_reduce_op(op)
    return _cpu._then(dist.all_reduce(flat, torch_op, group=group, async_op=True), async_op, finish)
