"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (ds_core's host Adam, :mod:`ds_core.ops.cpu_adam`)
and ``FusedAdam`` (torch's fused Adam / AdamW, :mod:`ds_core.ops.adam.fused_adam`)."""

from __future__ import annotations

from ds_core.ops.adam.fused_adam import FusedAdam
from ds_core.ops.cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
