"""Process groups and collectives over the comm hooks.

The engine calls these functions and the facade's collectives, never ``torch.distributed``
collectives directly, so every byte it moves passes through the comm hooks (and any wrapper
plugin counting them). The collectives as functions are in :mod:`ds_core.comm.collectives`; process groups and
their caches in :mod:`ds_core.comm.groups`;
the core's default collectives in :mod:`ds_core.default_plugin` (re-exported here, where
backends have always imported them from); byte counting in :mod:`ds_core.comm.counting`.
"""

from __future__ import annotations

from ds_core.comm.collectives import (
    all_gather,
    all_reduce,
    barrier,
    batch_isend_irecv,
    broadcast,
    irecv,
    isend,
    recv,
    reduce_scatter,
    send,
)
from ds_core.comm.compat import ReduceOp, get_local_rank, init_distributed, is_initialized
from ds_core.comm.groups import (
    ExpertGroups,
    destroy_distributed,
    expert_groups,
    get_rank,
    get_world_size,
    new_group,
    on_destroy,
    reset_expert_groups,
)
from ds_core.comm.mesh import Mesh, device_mesh, reset_device_mesh
from ds_core.default_plugin import DefaultCollectives, torch_reduce_op
from ds_core.types import P2POp

__all__ = [
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "reduce_scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "ReduceOp",
    "DefaultCollectives",
    "ExpertGroups",
    "Mesh",
    "device_mesh",
    "reset_device_mesh",
    "destroy_distributed",
    "expert_groups",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "new_group",
    "on_destroy",
    "reset_expert_groups",
    "torch_reduce_op",
]
