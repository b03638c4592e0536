"""Ulysses sequence parallelism (docs/architecture.md §10).

Each rank of a sequence-parallel (SP) group holds a contiguous slice of every sequence of the
batch its group reads; attention exchanges sequence shards for head shards and back
(:class:`DistributedAttention`, DeepSpeed 0.19.8's ``sequence/layer.py``); everything else in
the model is per token and runs on the shard unchanged. The SP group comes from the engine's
mesh (``sequence_parallel_size`` in the config; ``engine.mesh.sp_group``), and ZeRO partitions
over the SP × data-parallel group and, as DeepSpeed, sums gradients over the SP ranks and
averages over data replicas: each SP rank's loss is the full sequences' mean
(:func:`sequence_parallel_cross_entropy`).

- :mod:`ds_core.parallel.sequence.layer`: :class:`DistributedAttention`, :func:`seq_all_to_all`;
- :mod:`ds_core.parallel.sequence.data`: :func:`shard_sequence`, :func:`shard_offset`,
  :func:`sequence_parallel_cross_entropy`.

DeepSpeed's import path, ``ds_core.sequence.layer.DistributedAttention``, re-exports these.
"""

from __future__ import annotations

from ds_core.parallel.sequence.data import (
    sequence_parallel_cross_entropy,
    shard_offset,
    shard_sequence,
)
from ds_core.parallel.sequence.layer import DistributedAttention, seq_all_to_all

__all__ = [
    "DistributedAttention",
    "seq_all_to_all",
    "sequence_parallel_cross_entropy",
    "shard_offset",
    "shard_sequence",
]
