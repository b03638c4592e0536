"""ZeRO++ at stage 3: which units gather quantized weights (qwZ), which keep a copy inside the
node (hpZ), and the node groups of quantized gradient reductions (qgZ). The collectives are
:mod:`ds_core.comm.quantized`; :class:`~ds_core.zero.partition.FlatUnit` and
:class:`~ds_core.zero.reducer.GradReducer` use them."""

from __future__ import annotations

import logging
import math

from ds_core.comm.quantized import NodeGroups, node_groups
from ds_core.errors import ConfigError
from ds_core.zero.config import ZeroConfig
from ds_core.zero.partition import FlatUnit, Mode

__all__ = ["configure_zeropp", "qgz_block"]

log = logging.getLogger("ds_core.zero")


def qgz_block(shapes: list[tuple[int, ...]], world: int) -> int:
    """qgZ's elements per scale for a unit holding parameters of ``shapes``: DeepSpeed 0.19.8's
    group, ``numel / max(shape[0], shape[1], world)`` of each parameter of 2 or more dimensions
    (``deepspeed/runtime/comm/coalesced_collectives.py`` ``all_to_all_quant_reduce``: its
    ``intra_quant_group`` is a count of groups; ``min(rows, cols)`` for a weight matrix), the
    smallest over the unit, as one block size serves the unit's flat buffer. 0 when every
    parameter is 1-D: DeepSpeed reduces those (biases, norms) unquantized."""
    numel = [(s, math.prod(s)) for s in shapes if len(s) >= 2]
    groups = [n // max(s[0], s[1], world) for s, n in numel if n]
    return max(2, min(groups)) if groups else 0


def configure_zeropp(
    units: list[FlatUnit], zcfg: ZeroConfig, tp_size: int, world: int, rank: int
) -> NodeGroups | None:
    """Apply ``zero_quantized_weights`` (qwZ) and ``zero_hpz_partition_size`` (hpZ) to the
    partitioned ``units``; return qgZ's node groups when ``zero_quantized_gradients`` is on.
    Collective (it may create process groups).

    :param tp_size: the tensor-parallel size (hpZ and qgZ need 1).
    :param world: ranks in the world; ``rank``: this one.
    :raises ConfigError: an hpZ size that does not divide the world, nodes
        (``LOCAL_WORLD_SIZE``) that do not, or hpZ / qgZ with tensor parallelism.
    """
    partitioned = [u for u in units if u.mode is Mode.PARTITIONED]
    for unit in partitioned:
        unit.quantized_gather = bool(zcfg.zero_quantized_weights)
    hpz = zcfg.zero_hpz_partition_size
    if (hpz > 1 or zcfg.zero_quantized_gradients) and tp_size > 1:
        raise ConfigError(
            "zero_optimization.zero_hpz_partition_size / zero_quantized_gradients with "
            "tensor_parallel.autotp_size > 1 is not supported; use one of them"
        )
    if hpz == world > 1:
        # One node: the in-node group is the whole world, so a second copy would only replace
        # qwZ's quantized backward gathers with full ones; stage 3 as it is already is hpZ.
        log.info("zero_hpz_partition_size %d covers all %d ranks: no second copy", hpz, world)
        hpz = 1
    if hpz > 1:
        if world % hpz:
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size: {hpz} does not divide the "
                f"world size {world}; use the ranks per node (LOCAL_WORLD_SIZE)"
            )
        nodes = node_groups(hpz)
        for unit in partitioned:
            if unit.group is None:  # experts gather over their own groups
                unit.enable_secondary(nodes.intra, hpz, rank % hpz)
    if not zcfg.zero_quantized_gradients:
        return None
    for unit in units:
        unit.qgz_block = qgz_block([tuple(zp.shape) for zp in unit.zparams], world)
    try:
        return node_groups()
    except ValueError as exc:
        raise ConfigError(f"zero_optimization.zero_quantized_gradients: {exc}") from None
