"""How a model's parameters become an engine's: one :class:`ZeroParam` each, grouped into
flat units and moved onto the device equal on every rank, and their masters (fp32, or bf16
with ``bf16.bf16_master_weights_and_grads``).

:class:`StagePlan` says what the configured ZeRO stage does; the engine builds it once, and
every part of the engine decides by its named flags, never by the stage number.
:class:`Placement` does the placing once, inside :class:`~ds_core.zero.engine.ZeroEngine`'s
constructor; the engine owns what it builds (``zparams``, ``units``, ``param_swap``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ds_core import comm
from ds_core.accelerator import Accelerator
from ds_core.comm import Mesh
from ds_core.parallel.expert.moe import expert_groups, expert_parallel_size
from ds_core.parallel.tensor import is_tp_sharded
from ds_core.zero.config import DSConfig
from ds_core.zero.offload.host import OptimizerOffload
from ds_core.zero.offload.nvme_param import ParamSwapper
from ds_core.zero.partition import (
    ZERO_PARAM_ATTR,
    FlatUnit,
    Mode,
    ZeroParam,
    bucketize,
    set_param_data,
)
from ds_core.zero.partitioned_init import INIT_ATTR, restore_full
from ds_core.zero.stage3 import hooked_parameters, leaf_modules

log = logging.getLogger("ds_core.zero")


@dataclass(frozen=True)
class StagePlan:
    """What a ZeRO stage does, decided once from the config: the only place the engine reads
    the stage number (``stage`` stays for messages, checkpoint metadata and DeepSpeed's
    ``zero_optimization_stage()``).

    =====  ===============  ===========================================  ======================
    stage  optimizer state  gradients                                    parameters
    =====  ===============  ===========================================  ======================
    0      whole per rank   summed locally over the window, all-reduced  whole on every rank
                            by its last backward
    1      partitioned      summed locally, reduce-scattered by the      whole; each rank's
                            window's last backward (with one micro-batch  updated range is
                            per step: reduce-scattered every backward)   all-gathered after
                                                                         the step
    2      partitioned      reduce-scattered every backward, the range   as stage 1
                            summed over the window
    3      partitioned      as stage 2                                   partitioned (above
                                                                         the persistence
                                                                         threshold): gathered
                                                                         around each use,
                                                                         released after
    =====  ===============  ===========================================  ======================
    """

    #: the configured ZeRO stage (0-3); not read to decide behaviour.
    stage: int
    #: each rank keeps optimizer state (and masters) for its own range of each unit only.
    partitions_optimizer_state: bool
    #: each backward reduce-scatters its gradients: no rank keeps a full gradient across
    #: micro-batches (DeepSpeed's "gradient partitioning", which refuses ``no_sync``).
    partitions_gradients: bool
    #: parameters above ``stage3_param_persistence_threshold`` are held as this rank's range,
    #: gathered around each module's forward and backward and released after.
    partitions_parameters: bool
    #: gradients are all-reduced (every rank gets the whole mean), else reduce-scattered.
    all_reduces_gradients: bool
    #: micro-batches sum into a full local accumulator and only the window's last backward
    #: reduces it; else every backward reduces into the persistent range.
    accumulates_locally: bool

    @classmethod
    def for_stage(cls, stage: int, gas: int) -> StagePlan:
        """The plan of ZeRO ``stage`` with ``gas`` gradient accumulation steps.

        :raises ValueError: ``stage`` outside 0-3 (the config schema already refuses it).
        """
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        return cls(
            stage=stage,
            partitions_optimizer_state=stage >= 1,
            partitions_gradients=stage >= 2,
            partitions_parameters=stage == 3,
            all_reduces_gradients=stage == 0,
            # With one micro-batch per step stage 1 has nothing to accumulate: it reduces
            # every backward like stage 2.
            accumulates_locally=stage == 0 or (stage == 1 and gas > 1),
        )

    @classmethod
    def from_config(cls, config: DSConfig) -> StagePlan:
        """The plan ``config`` asks for (its stage and ``gradient_accumulation_steps``)."""
        return cls.for_stage(config.zero_optimization.stage, config.gradient_accumulation_steps)


class Placement:
    """Places ``model`` for an engine of ``plan``'s stage on ``acc``'s device over ``mesh``.

    After construction: ``zparams`` (by name, unique parameters), ``by_param`` (``id(param)``
    to its :class:`ZeroParam`), ``trainable``, ``units`` and ``param_swap`` (NVMe parameter
    offload's swap files and buffers, see [Note: NVMe parameter swap], or ``None``). Each rank
    keeps only what it holds; one full parameter is on the device at a time. Collective: every
    rank constructs it (the parameters are broadcast).
    """

    def __init__(
        self,
        model: nn.Module,
        config: DSConfig,
        acc: Accelerator,
        mesh: Mesh,
        model_dtype: torch.dtype | None,
        plan: StagePlan,
    ) -> None:
        self.zcfg = config.zero_optimization
        self.aio = config.aio
        self.plan = plan
        self.acc = acc
        self.device = acc.device()
        self.mesh = mesh
        self.world = comm.get_world_size()
        self.rank = comm.get_rank()
        self.model_dtype = model_dtype
        self.zparams: dict[str, ZeroParam] = {}
        self.by_param: dict[int, ZeroParam] = {}
        for name, p in model.named_parameters():
            zp = self._zparam(name, p)
            self.zparams[name] = zp
            self.by_param[id(p)] = zp
        self.param_swap: ParamSwapper | None = None
        #: stage 3's leaf modules (``zero_optimization.leaf_module``): one unit per subtree.
        self.leaves: set[nn.Module] = (
            leaf_modules(model, self.zcfg.leaf_module) if plan.partitions_parameters else set()
        )
        self.units: list[FlatUnit] = self._build_units(model)
        self._place(model)
        self.trainable = [zp for zp in self.zparams.values() if zp.trainable]

    def _zparam(self, name: str, p: nn.Parameter) -> ZeroParam:
        zcfg = self.zcfg
        ep = expert_parallel_size(p)
        if ep is not None and ep > 1:
            # EP and EDP groups run along the data-parallel dimension of the mesh; the experts
            # are whole (replicated) on the ranks of one TP group.
            groups = expert_groups(ep, self.mesh.tp_size)
            group, gworld = groups.edp_group, groups.edp_world
            grank = comm.get_rank(group) if group is not None else self.rank
        elif self.mesh.dp_group is not None:
            # With TP or pipeline stages the DP group is part of the world (a stage's ranks).
            group, gworld, grank = self.mesh.dp_group, self.mesh.dp_size, self.mesh.dp_rank
        else:
            group, gworld, grank = None, self.world, self.rank
        numel = getattr(p, INIT_ATTR)[2] if hasattr(p, INIT_ATTR) else p.numel()
        if self.plan.partitions_parameters and numel > zcfg.stage3_param_persistence_threshold:
            mode = Mode.PARTITIONED
        elif self.plan.partitions_optimizer_state and p.requires_grad:
            mode = Mode.SHARDED_STATE
        else:
            mode = Mode.REPLICATED
        zp = ZeroParam(name, p, mode, group, gworld, grank, ep)
        zp.tp_sharded = is_tp_sharded(p)
        if hasattr(p, INIT_ATTR):
            # Built under zero.Init: the parameter is a placeholder until placed.
            _, zp.shape, zp.numel = getattr(p, INIT_ATTR)
            zp.hi = zp.numel
        if self.model_dtype is not None and zp.dtype.is_floating_point:
            zp.dtype = self.model_dtype
        setattr(p, ZERO_PARAM_ATTR, zp)
        return zp

    def _build_units(self, model: nn.Module) -> list[FlatUnit]:
        """Group parameters into units (see [Note: shard layout]): reduce buckets of
        ``reduce_bucket_size`` elements, and at stage 3 one unit per module's own parameters
        (a leaf module's: its subtree's, :mod:`ds_core.zero.stage3`)."""
        limit = self.zcfg.reduce_bucket_size
        units: list[FlatUnit] = []
        if self.plan.partitions_parameters:
            pcfg = self.zcfg.offload_param
            host = pcfg.device in ("cpu", "nvme")
            if pcfg.device == "nvme":
                self.param_swap = ParamSwapper(self.acc, pcfg, self.aio, self.rank)
            if host and "pinned_memory" not in self.acc.capabilities:
                log.info(
                    "offload_param: backend '%s' does not declare pinned_memory; host "
                    "shards are pageable and their copies to the device synchronous",
                    self.acc.name,
                )
            seen: set[int] = set()
            for _, params in hooked_parameters(model, self.leaves):
                own = [
                    self.by_param[id(p)]
                    for p in params
                    if p is not None and id(p) not in seen and id(p) in self.by_param
                ]
                own = [zp for zp in own if zp.mode is Mode.PARTITIONED]
                seen.update(id(zp.param) for zp in own)
                # frozen parameters in units of their own: a unit's gradient buffer covers
                # every element, and a frozen one's range would never be written (a leaf
                # module can hold both kinds)
                trainable = [zp for zp in own if zp.trainable]
                frozen = [zp for zp in own if not zp.trainable]
                for part in bucketize(trainable, limit) + bucketize(frozen, limit):
                    units.append(
                        FlatUnit(part, Mode.PARTITIONED, self.device, host, self.param_swap)
                    )
        for mode in (Mode.REPLICATED, Mode.SHARDED_STATE):
            members = [zp for zp in self.zparams.values() if zp.mode is mode and zp.trainable]
            for part in bucketize(members, limit):
                units.append(FlatUnit(part, mode, self.device))
        return units

    def reduction_order(self) -> list[FlatUnit]:
        """The units in the order backward completes their gradients: the gradient reducer
        issues one collective per unit in this order (the same on every rank).

        Backward runs roughly in reverse registration order, so a unit completes when the
        gradient of its earliest-registered parameter arrives; the unit whose first parameter
        registered last goes first. A unit that spans the model (stage 3's persistent
        parameters: every layer's biases and norms; a tied embedding) completes only at the end
        of backward and goes last; issued earlier, it would make every later unit wait with its
        gradients staged, one full-size staging buffer each (bench/README.md, memory_formula.py).
        """
        index = {id(zp): i for i, zp in enumerate(self.zparams.values())}
        return sorted(
            self.units, key=lambda u: min(index[id(zp)] for zp in u.zparams), reverse=True
        )

    def _place(self, module: nn.Module) -> None:
        """Move the module onto the device one parameter at a time, equal on every rank
        (broadcast from rank 0; experts from the first rank of their group), keeping only
        what this rank holds."""
        with torch.no_grad():
            for zp in self.zparams.values():
                p = zp.param
                if hasattr(p, INIT_ATTR):
                    # zero.Init broadcast it from rank 0 before partitioning; rebuild it here.
                    restore_full(p, self.device, zp.dtype)
                    full = p.data
                else:
                    full = p.data.to(self.device, zp.dtype)
                    self._broadcast(full, zp)
                if zp.unit is not None:
                    zp.unit.place(zp, full)
                else:
                    set_param_data(p, full)
            for sub in module.modules():
                for key, b in sub._buffers.items():
                    if b is None:
                        continue
                    dtype = self.model_dtype if b.is_floating_point() and self.model_dtype else None
                    moved = b.to(self.device, dtype)
                    self._broadcast(moved, None)
                    sub._buffers[key] = moved

    def _broadcast(self, t: torch.Tensor, zp: ZeroParam | None) -> None:
        if self.world == 1:
            return
        ep = zp.expert_ep_size if zp is not None else None
        if ep is not None and ep > 1:
            g = expert_groups(ep, self.mesh.tp_size)
            if g.edp_world > 1:
                self.acc.broadcast(t, g.edp_src, g.edp_group)
        elif zp is not None and zp.tp_sharded:
            # A TP shard is equal across its DP group only (from the group's first rank).
            if self.mesh.dp_size > 1:
                self.acc.broadcast(t, self.mesh.dp_src, self.mesh.dp_group)
        elif self.mesh.pp_size > 1:
            # Each pipeline stage holds other layers: equal within the stage only.
            if self.mesh.dp_size > 1:
                self.acc.broadcast(t, self.mesh.dp_src, self.mesh.dp_group)
            if self.mesh.tp_size > 1:
                self.acc.broadcast(t, self.mesh.tp_src, self.mesh.tp_group)
        else:
            self.acc.broadcast(t, 0, None)

    def make_masters(
        self, offload: OptimizerOffload | None, dtype: torch.dtype = torch.float32
    ) -> None:
        """Masters of each trainable parameter's piece, in ``dtype`` (fp32; bf16 with
        ``bf16.bf16_master_weights_and_grads``); a parameter already in ``dtype`` is its own
        master (the optimizer steps the unit's storage in place, so no copy exists)."""
        if offload is not None:
            offload.make_masters(
                [u for u in self.units if u.trainable and u.mode is not Mode.REPLICATED]
            )
        with torch.no_grad():
            for zp in self.trainable:
                if offload is not None and offload.holds(zp.unit):
                    continue
                if zp.mode is Mode.REPLICATED:
                    p = zp.param
                    zp.master = p if p.dtype == dtype else nn.Parameter(p.detach().to(dtype))
                    continue
                assert zp.unit is not None
                piece = zp.unit.piece(zp)
                if zp.unit.host_shard:  # offload_param: the optimizer steps on the device
                    zp.master = nn.Parameter(piece.to(self.device, dtype, copy=True))
                    continue
                zp.master = nn.Parameter(piece if piece.dtype == dtype else piece.to(dtype))
