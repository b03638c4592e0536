"""Broken: reduce-scatter picks its chunk by global rank instead of rank in the group."""

from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.comm import torch_reduce_op
from ds_core.types import COMPLETED, BackendInfo, Work  # noqa: F401 - BackendInfo: identity


@hookimpl
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    """An all-reduce, then this rank's chunk; ``dist.get_rank()`` where the group's is needed."""
    world = dist.get_world_size(group)
    rank = dist.get_rank() % world  # the bug: the global rank, folded into range
    # gloo has no int16 collectives: carry int16 as int32 (exact), like the CPU backend does.
    flat = input.to(torch.int32 if input.dtype == torch.int16 else input.dtype, copy=True)
    flat = flat.reshape(-1)
    dist.all_reduce(flat, dist.ReduceOp.SUM if op == "avg" else torch_reduce_op(op), group=group)
    n = output.numel()
    chunk = flat[rank * n : (rank + 1) * n]
    output.view(-1).copy_(chunk / world if op == "avg" else chunk)
    return COMPLETED  # completed before returning, which the contract allows for async_op too
