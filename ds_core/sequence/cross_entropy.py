"""``deepspeed.sequence.cross_entropy``'s place: ds_core's loss for sharded sequences,
:func:`sequence_parallel_cross_entropy` (from :mod:`ds_core.parallel.sequence.data`).

DeepSpeed 0.19.8's vocabulary-parallel functions here are not provided: their gradients assume
DeepSpeed's sum over SP ranks, where ds_core's engine averages (docs/from-deepspeed.md).
"""

from __future__ import annotations

from ds_core.parallel.sequence.data import sequence_parallel_cross_entropy

__all__ = ["sequence_parallel_cross_entropy"]
