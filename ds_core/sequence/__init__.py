"""``deepspeed.sequence``: Ulysses sequence parallelism at DeepSpeed's import path.

``ds_core.sequence.layer.DistributedAttention`` is :class:`ds_core.parallel.sequence.DistributedAttention`;
``ds_core.sequence.cross_entropy`` holds DeepSpeed's ``vocab_sequence_parallel_cross_entropy``
and ds_core's loss helper for sharded sequences. The implementation lives in
:mod:`ds_core.parallel.sequence`.
"""

from __future__ import annotations

from ds_core.parallel.sequence import DistributedAttention, sequence_parallel_cross_entropy

__all__ = ["DistributedAttention", "sequence_parallel_cross_entropy"]
