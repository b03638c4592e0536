"""``deepspeed.ops.adam.cpu_adam``'s path for :class:`ds_core.ops.cpu_adam.DeepSpeedCPUAdam`."""

from __future__ import annotations

from ds_core.ops.cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
