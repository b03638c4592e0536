"""``deepspeed.runtime.lr_schedules``'s names: ``from ds_core.runtime.lr_schedules import
WarmupLR`` works as with DeepSpeed. The classes are :mod:`ds_core.zero.compat.builders`'s.

``OneCycle`` is not implemented: importing it raises ``ImportError`` naming the alternatives.
"""

from __future__ import annotations

from typing import Any

from ds_core.zero.compat.builders import LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

#: DeepSpeed's schedule names that ds_core does not implement, with what to use instead.
NOT_SUPPORTED = {
    "OneCycle": "use WarmupCosineLR, or torch.optim.lr_scheduler.OneCycleLR passed as "
    "lr_scheduler= to initialize()",
}


def __getattr__(name: str) -> Any:
    if name in NOT_SUPPORTED:
        raise ImportError(f"{name} is not supported by ds_core; {NOT_SUPPORTED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
