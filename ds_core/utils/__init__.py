"""``deepspeed.utils``'s names that programs import: ``logger``, ``log_dist`` and the
``groups`` getters (:mod:`ds_core.utils.groups`)."""

from __future__ import annotations

from ds_core.utils import groups
from ds_core.utils.logging import log_dist, logger

__all__ = ["groups", "log_dist", "logger"]
