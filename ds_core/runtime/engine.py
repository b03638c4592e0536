"""``deepspeed.runtime.engine.DeepSpeedEngine``: ds_core's engine under DeepSpeed's name, for
``isinstance`` checks and annotations (``ds_core.initialize`` builds it)."""

from __future__ import annotations

from ds_core.zero.engine import ZeroEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
