"""The ZeRO engine: configuration, partitioning per stage, precision, clipping, accumulation.

Public API: :func:`initialize` (also ``ds_core.initialize``), :class:`ZeroEngine`,
:class:`ZeroParam` (one per parameter: shard layout, fp32 master), :class:`LossScaler` and
:class:`GatheredParameters` (scoped full parameters in stage 3) and :class:`Init` (build a
model already partitioned).
Configuration lives in :mod:`ds_core.zero.config`, optimizer and schedule builders in
:mod:`ds_core.zero.compat.builders`.
"""

from __future__ import annotations

from ds_core.zero.compat.builders import needs_full_gradients
from ds_core.zero.compat.entry import add_config_arguments, initialize
from ds_core.zero.engine import ZeroEngine
from ds_core.zero.gathered import GatheredParameters
from ds_core.zero.partition import Mode, ZeroParam
from ds_core.zero.partitioned_init import Init
from ds_core.zero.precision import LossScaler

__all__ = [
    "GatheredParameters",
    "Init",
    "LossScaler",
    "Mode",
    "ZeroEngine",
    "ZeroParam",
    "add_config_arguments",
    "initialize",
    "needs_full_gradients",
]
