"""``deepspeed.runtime.config.DeepSpeedConfig``: ds_core's parsed config under DeepSpeed's
name, for ``isinstance`` checks and annotations. It is a pydantic model: build one with
``DeepSpeedConfig.model_validate(config_dict)``, not from a path as DeepSpeed's constructor
takes."""

from __future__ import annotations

from ds_core.zero.config import DSConfig as DeepSpeedConfig

__all__ = ["DeepSpeedConfig"]
