"""``deepspeed.runtime.zero``'s names: ``GatheredParameters``, ``Init`` and
:mod:`~ds_core.runtime.zero.partition_parameters`."""

from __future__ import annotations

from ds_core.runtime.zero import partition_parameters
from ds_core.runtime.zero.partition_parameters import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
