"""``deepspeed.sequence.layer``: :class:`DistributedAttention` (from
:mod:`ds_core.parallel.sequence.layer`)."""

from __future__ import annotations

from ds_core.parallel.sequence.layer import DistributedAttention, seq_all_to_all

__all__ = ["DistributedAttention", "seq_all_to_all"]
