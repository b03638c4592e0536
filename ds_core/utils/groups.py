"""``deepspeed.utils.groups``: the process-group getters code written for DeepSpeed calls,
answered from ds_core's groups.

- Data / model parallel: the mesh of :mod:`ds_core.comm.mesh` (data-parallel × AutoTP). The
  engine creates it; before that (or without tensor parallelism) data parallelism is the world
  and the model-parallel size is 1. ``None`` from ds_core (no subgroup) is returned as
  ``torch.distributed.group.WORLD`` for the data-parallel group, as DeepSpeed returns a world
  group.
- Expert parallel: :func:`ds_core.comm.expert_groups`, named as DeepSpeed names them
  (``ep_size_<E>``, see :mod:`ds_core.moe.layer`). Asking for a name whose groups were never
  created fails as in DeepSpeed (``AssertionError``). For ``ep_size`` 1 the expert-parallel
  group is ``None`` (one rank: nothing to exchange).
- Sequence parallel (Ulysses, :mod:`ds_core.parallel.sequence`): the mesh's SP axis
  (``sequence_parallel_size``). Without it the answers are DeepSpeed's: world size 1, rank 0,
  and no group (``KeyError``). The sequence-data-parallel group is ZeRO's group, the SP ranks
  included (DeepSpeed's ``seq_data_parallel``: the mesh's DP group, as for the data-parallel
  getters above, which answer from the same group).

Every getter but the sequence-parallel size and rank needs ``torch.distributed`` initialised.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ds_core.comm import groups as _groups
from ds_core.comm import mesh as _mesh
from ds_core.comm.groups import ExpertGroups, get_rank

__all__ = [
    "_get_broadcast_src_rank",
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_world_size",
    "_get_model_parallel_group",
    "_get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]


def _initialized() -> None:
    assert dist.is_available() and dist.is_initialized(), "dist is not initialized"


def _mesh_now() -> _mesh.Mesh:
    """The mesh of the engine built last (the last ``device_mesh`` call), else the plain
    data-parallel one: DeepSpeed's getters answer from the groups its last ``initialize`` set."""
    _initialized()
    return _mesh.current_mesh() or _mesh.device_mesh(1)


# -- data and model parallel -----------------------------------------------------------------


def _get_data_parallel_group() -> Any:
    """This rank's data-parallel group."""
    group = _mesh_now().dp_group
    return dist.group.WORLD if group is None else group


def _get_data_parallel_world_size() -> int:
    return _mesh_now().dp_size


def _get_data_parallel_rank() -> int:
    return _mesh_now().dp_rank


def _get_broadcast_src_rank() -> int:
    """Global rank of the first member of this rank's data-parallel group."""
    return _mesh_now().dp_src


def _get_model_parallel_group() -> Any:
    """This rank's tensor-parallel group (``None`` without tensor parallelism)."""
    return _mesh_now().tp_group


def _get_model_parallel_world_size() -> int:
    mesh = _mesh.current_mesh()
    return mesh.tp_size if mesh is not None else 1


def _get_model_parallel_rank() -> int:
    return _mesh_now().tp_rank


# -- expert parallel -------------------------------------------------------------------------


def _expert(group_name: str, what: str) -> ExpertGroups:
    for (ep_size, _tp), groups in list(_groups._expert_groups.items()):
        if group_name == f"ep_size_{ep_size}":
            return groups
    raise AssertionError(f"{what} group is not initialized")


def _get_expert_parallel_group(group_name: str) -> Any:
    """The expert-parallel group ``group_name`` (``ep_size_<E>``) of this rank."""
    return _expert(group_name, "expert parallel").ep_group


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The expert-data-parallel group of this rank (``None``: the world)."""
    return _expert(group_name, "expert data parallel").edp_group


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {f"ep_size_{ep}": g.ep_group for (ep, _tp), g in list(_groups._expert_groups.items())}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {f"ep_size_{ep}": g.edp_group for (ep, _tp), g in list(_groups._expert_groups.items())}


def _get_expert_parallel_world_size(group_name: str) -> int:
    _initialized()
    return _expert(group_name, "expert parallel").ep_size


def _get_expert_parallel_rank(group_name: str) -> int:
    _initialized()
    return _expert(group_name, "expert parallel").ep_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    _initialized()
    return _expert(group_name, "expert data parallel").edp_world


def _get_expert_data_parallel_rank(group_name: str) -> int:
    _initialized()
    g = _expert(group_name, "expert data parallel")
    dp_rank = get_rank() // _get_model_parallel_world_size()
    return dp_rank // g.ep_size


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    _initialized()
    return _expert(group_name, "expert data parallel").edp_src


# -- sequence parallel ------------------------------------------------------------------------


def _get_sequence_parallel_world_size() -> int:
    """Ranks each sequence is split over (1 without sequence parallelism)."""
    return _mesh_now().sp_size


def _get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group (0 without sequence parallelism)."""
    return _mesh_now().sp_rank if dist.is_initialized() else 0


def _get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group.

    :raises KeyError: without sequence parallelism (``sequence_parallel_size`` 1), as DeepSpeed.
    """
    if not dist.is_initialized() or _mesh_now().sp_size == 1:
        raise KeyError(
            "No sequence parallel group found (sequence_parallel_size is 1; set it in the "
            "config to split sequences over ranks)"
        )
    return _mesh_now().sp_group


def _get_sequence_data_parallel_world_size() -> int:
    """Ranks ZeRO partitions and averages over: data replicas × sequence-parallel ranks."""
    return _mesh_now().dp_size


def _get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence-data-parallel group."""
    return _mesh_now().dp_rank


def _get_sequence_data_parallel_group() -> Any:
    """The sequence-data-parallel group (ZeRO's; the world group when it is every rank)."""
    return _get_data_parallel_group()
