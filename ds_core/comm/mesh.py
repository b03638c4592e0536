"""The device mesh: pipeline × data × sequence × tensor process groups and this rank's coordinates.

Layout (Megatron's and DeepSpeed's ``PipeModelDataParallelTopology``, with Ulysses' sequence
axis inside the data axis): tensor-parallel ranks are adjacent, so a TP group stays inside a
node when ``tp_size`` divides the ranks per node; sequence-parallel ranks come next, then data
replicas, and pipeline stages are outermost. With ``T = tp_size``, ``S = sp_size`` and
``D = dp_size`` (data replicas × ``S``: every rank of one stage and one TP shard):

- ``tp_rank = rank % T``, ``dp_rank = (rank // T) % D``, ``pp_rank = rank // (D·T)``;
- ``sp_rank = dp_rank % S``; the batch a rank reads is ``data_rank = dp_rank // S`` of
  ``data_size = D // S``;
- TP groups: ``T`` consecutive ranks; SP groups: ``S`` ranks ``T`` apart inside one data
  replica; DP groups: the ``D`` ranks of one stage holding the same TP shard; pipeline groups:
  the ``pp_size`` ranks with the same ``(dp_rank, tp_rank)``, one per stage.

ZeRO partitions and reduces every parameter over its DP group only — with sequence
parallelism that group includes the SP ranks (DeepSpeed's ``seq_data_parallel`` group: each
SP rank computes gradients on its own part of the sequence); a TP group computes one model
replica on one batch (its ranks see the same data), and so does an SP group.

Why not ``torch.distributed.device_mesh.DeviceMesh``: it creates its process groups itself
(``init_device_mesh`` calls ``torch.distributed.new_group`` / ``split_group`` with a backend it
derives from the device type), while every group here must come from
:func:`ds_core.comm.new_group`, created with the selected backend's comm name, and released by
:func:`ds_core.comm.destroy_distributed`. Its users (DTensor, ``parallelize_module``) then run
their collectives through torch's functional collectives, not the comm hooks, so a backend's
collective overrides and byte-counting plugins would not see them. What the engine needs from
a mesh is a few groups and integers, so this module keeps exactly that. A user who wants a
``DeviceMesh`` for their own DTensor code can wrap these groups without creating new ones
(``DeviceMesh.from_group([mesh.dp_group, mesh.tp_group], device_type, mesh=...)``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ds_core.comm.groups import get_rank, get_world_size, new_group, on_destroy

__all__ = ["Mesh", "current_mesh", "device_mesh", "reset_device_mesh"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """This rank's place in a pipeline × data × sequence × tensor mesh.

    :param tp_size: ranks a tensor-parallel layer is split over.
    :param dp_size: ranks of one pipeline stage holding the same TP shard (``world //
        (pp_size · tp_size)``); ZeRO's group, sequence-parallel ranks included.
    :param tp_rank: this rank's index in its TP group.
    :param dp_rank: this rank's index in its DP group.
    :param tp_group: this rank's TP group (``None`` when ``tp_size`` is 1: nothing to exchange).
    :param dp_group: this rank's DP group (``None`` = the world, when it is the whole world).
    :param pp_size: pipeline stages.
    :param pp_rank: this rank's stage.
    :param pp_group: the ranks of this rank's pipeline, one per stage, in stage order
        (``None`` when ``pp_size`` is 1).
    :param sp_size: ranks a sequence is split over (Ulysses).
    :param sp_rank: this rank's index in its SP group.
    :param sp_group: this rank's SP group (``None`` when ``sp_size`` is 1).
    """

    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: Any
    dp_group: Any
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None
    sp_size: int = 1
    sp_rank: int = 0
    sp_group: Any = None

    @property
    def stage_size(self) -> int:
        """Ranks in one pipeline stage (``dp_size · tp_size``)."""
        return self.dp_size * self.tp_size

    @property
    def dp_src(self) -> int:
        """Global rank of the first member of this rank's DP group (a broadcast source)."""
        return self.pp_rank * self.stage_size + self.tp_rank

    @property
    def tp_src(self) -> int:
        """Global rank of the first member of this rank's TP group."""
        return self.pp_rank * self.stage_size + self.dp_rank * self.tp_size

    @property
    def data_size(self) -> int:
        """Distinct batches per step: data-parallel replicas (``dp_size // sp_size``)."""
        return self.dp_size // self.sp_size

    @property
    def data_rank(self) -> int:
        """Which of the ``data_size`` batches this rank reads (equal across TP and SP groups)."""
        return self.dp_rank // self.sp_size

    def stage_rank(self, stage: int) -> int:
        """Global rank of this rank's counterpart in pipeline ``stage`` (same DP and TP index).

        :raises ValueError: when ``stage`` is not in ``[0, pp_size)``.
        """
        if not 0 <= stage < self.pp_size:
            raise ValueError(f"stage {stage} is outside [0, {self.pp_size})")
        return stage * self.stage_size + self.dp_rank * self.tp_size + self.tp_rank


_lock = threading.Lock()
_meshes: dict[tuple[int, int, int], Mesh] = {}
#: the mesh the last :func:`device_mesh` call returned (an engine asks for its mesh when it is
#: built), which DeepSpeed-style group getters answer from (``ds_core.utils.groups``).
_current: Mesh | None = None


def current_mesh() -> Mesh | None:
    """The mesh the last :func:`device_mesh` call returned, or ``None`` before any (or after
    :func:`reset_device_mesh`)."""
    return _current


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def device_mesh(tp_size: int, pp_size: int = 1, sp_size: int = 1) -> Mesh:
    """The (cached) mesh for these sizes; the first call is collective on every rank.

    :param tp_size: tensor-parallel size.
    :param pp_size: pipeline stages.
    :param sp_size: sequence-parallel size.
    :raises ValueError: when a size is not a positive int, or ``pp_size · sp_size · tp_size``
        does not divide the world size.
    """
    tp_size = _positive("tp_size", tp_size)
    pp_size = _positive("pp_size", pp_size)
    sp_size = _positive("sp_size", sp_size)
    global _current
    key = (tp_size, pp_size, sp_size)
    cached = _meshes.get(key)
    if cached is not None:
        _current = cached
        return cached
    world, rank = get_world_size(), get_rank()
    if world % (tp_size * pp_size * sp_size):
        raise ValueError(
            f"pipeline {pp_size} × sequence {sp_size} × tensor {tp_size} parallel sizes do not "
            f"divide the world size {world}; choose sizes whose product divides the number "
            "of ranks"
        )
    dp_size = world // (tp_size * pp_size)
    stage = dp_size * tp_size
    pp_rank, tp_rank = rank // stage, rank % tp_size
    dp_rank = (rank % stage) // tp_size
    if key == (1, 1, 1):
        mesh = Mesh(1, world, 0, rank, None, None)
    else:
        # Every rank creates every group in the same order, as torch.distributed requires.
        mine: dict[str, Any] = {"tp": None, "dp": None, "pp": None, "sp": None}

        def make(kind: str, ranks: list[int]) -> None:
            g = new_group(ranks)
            if rank in ranks:
                mine[kind] = g

        for p in range(pp_size):
            base = p * stage
            if tp_size > 1:
                for d in range(dp_size):
                    make("tp", [base + d * tp_size + t for t in range(tp_size)])
            if pp_size > 1 or tp_size > 1:
                for t in range(tp_size):
                    make("dp", [base + d * tp_size + t for d in range(dp_size)])
            if sp_size > 1:
                for t in range(tp_size):
                    for k in range(dp_size // sp_size):
                        make("sp", [base + (k * sp_size + s) * tp_size + t for s in range(sp_size)])
        if pp_size > 1:
            for i in range(stage):
                make("pp", [p * stage + i for p in range(pp_size)])
        mesh = Mesh(
            tp_size, dp_size, tp_rank, dp_rank, mine["tp"], mine["dp"],
            pp_size, pp_rank, mine["pp"], sp_size, dp_rank % sp_size, mine["sp"],
        )  # fmt: skip
    with _lock:
        _meshes[key] = mesh
    _current = mesh
    return mesh


def reset_device_mesh() -> None:
    """Forget cached meshes (``destroy_distributed`` does it)."""
    global _current
    with _lock:
        _meshes.clear()
        _current = None


on_destroy(reset_device_mesh)
