"""``deepspeed.runtime.zero.partition_parameters``: ``GatheredParameters`` and ``Init``, the
same objects as ``ds_core.zero``'s (``Init`` takes DeepSpeed's keyword arguments; see it for
which it accepts and which it refuses).
"""

from __future__ import annotations

from ds_core.zero.gathered import GatheredParameters
from ds_core.zero.partitioned_init import Init

__all__ = ["GatheredParameters", "Init"]
