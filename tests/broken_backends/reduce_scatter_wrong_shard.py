"""Broken: reduce-scatter leaves the next rank's shard in ``output``."""

from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import COMPLETED, BackendInfo, Work  # noqa: F401 - BackendInfo: identity


@hookimpl
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    world = dist.get_world_size(group)
    flat = input.view(-1).clone()
    dist.all_reduce(flat, group=group)
    shard = (dist.get_rank(group) + 1) % world
    n = output.numel()
    output.view(-1).copy_(flat[shard * n : (shard + 1) * n])
    return COMPLETED
