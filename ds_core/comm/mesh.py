"""The device mesh: data-parallel × tensor-parallel process groups and this rank's coordinates.

Layout (Megatron's and DeepSpeed AutoTP's): tensor-parallel ranks are adjacent, so a TP group
stays inside a node when ``tp_size`` divides the ranks per node. With ``T = tp_size``:

- ``tp_rank = rank % T``, ``dp_rank = rank // T``;
- TP groups ``{k·T, …, k·T + T − 1}`` (one per data-parallel replica);
- DP groups ``{j, j + T, j + 2T, …}`` (ranks holding the same TP shard).

ZeRO partitions and reduces every parameter over its DP group only; a TP group computes one
model replica on one batch (its ranks see the same data).

Why not ``torch.distributed.device_mesh.DeviceMesh``: it creates its process groups itself
(``init_device_mesh`` calls ``torch.distributed.new_group`` / ``split_group`` with a backend it
derives from the device type), while every group here must come from
:func:`ds_core.comm.new_group`, created with the selected backend's comm name, and released by
:func:`ds_core.comm.destroy_distributed`. Its users (DTensor, ``parallelize_module``) then run
their collectives through torch's functional collectives, not the comm hooks, so a backend's
collective overrides and byte-counting plugins would not see them. What the engine needs from
a mesh is two groups and four integers, so this module keeps exactly that. A user who wants a
``DeviceMesh`` for their own DTensor code can wrap these groups without creating new ones
(``DeviceMesh.from_group([mesh.dp_group, mesh.tp_group], device_type, mesh=...)``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ds_core.comm.groups import get_rank, get_world_size, new_group, on_destroy

__all__ = ["Mesh", "device_mesh", "reset_device_mesh"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """This rank's place in a data-parallel × tensor-parallel mesh.

    :param tp_size: ranks a tensor-parallel layer is split over.
    :param dp_size: data-parallel replicas (``world // tp_size``).
    :param tp_rank: this rank's index in its TP group (``rank % tp_size``).
    :param dp_rank: this rank's index in its DP group (``rank // tp_size``).
    :param tp_group: this rank's TP group (``None`` when ``tp_size`` is 1: nothing to exchange).
    :param dp_group: this rank's DP group (``None`` = the world, when ``tp_size`` is 1).
    """

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: Any
    dp_group: Any

    @property
    def dp_src(self) -> int:
        """Global rank of the first member of this rank's DP group (a broadcast source)."""
        return self.tp_rank

    @property
    def tp_src(self) -> int:
        """Global rank of the first member of this rank's TP group."""
        return self.dp_rank * self.tp_size


_lock = threading.Lock()
_meshes: dict[int, Mesh] = {}


def device_mesh(tp_size: int) -> Mesh:
    """The (cached) mesh for ``tp_size``; the first call is collective on every rank.

    :raises ValueError: when ``tp_size`` is not a positive int dividing the world size.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    cached = _meshes.get(tp_size)
    if cached is not None:
        return cached
    world, rank = get_world_size(), get_rank()
    if world % tp_size:
        raise ValueError(
            f"tensor-parallel size {tp_size} does not divide the world size {world}; "
            "choose an autotp_size that divides the number of ranks"
        )
    dp_size = world // tp_size
    if tp_size == 1:
        mesh = Mesh(1, world, 0, rank, None, None)
    else:
        # Every rank creates every group in the same order, as torch.distributed requires.
        tp_group = dp_group = None
        for k in range(dp_size):
            ranks = list(range(k * tp_size, (k + 1) * tp_size))
            g = new_group(ranks)
            if rank in ranks:
                tp_group = g
        for j in range(tp_size):
            ranks = list(range(j, world, tp_size))
            g = new_group(ranks)
            if rank in ranks:
                dp_group = g
        mesh = Mesh(tp_size, dp_size, rank % tp_size, rank // tp_size, tp_group, dp_group)
    with _lock:
        _meshes[tp_size] = mesh
    return mesh


def reset_device_mesh() -> None:
    """Forget cached meshes (``destroy_distributed`` does it)."""
    with _lock:
        _meshes.clear()


on_destroy(reset_device_mesh)
