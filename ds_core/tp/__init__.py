"""AutoTP under its earlier import path; the implementation is :mod:`ds_core.parallel.tensor`."""

from __future__ import annotations

from ds_core.parallel.tensor import (
    TP_ATTR,
    TP_FUSED_ATTR,
    CopyToTP,
    GatherFromTP,
    LinearColumnParallel,
    LinearRowParallel,
    ReduceFromTP,
    VocabParallelEmbedding,
    apply_autotp,
    is_tp_sharded,
    join_rows,
    model_tp_size,
    plan_autotp,
    replaced_parameters,
    slice_rows,
    tp_model_init,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "TP_ATTR",
    "TP_FUSED_ATTR",
    "CopyToTP",
    "GatherFromTP",
    "LinearColumnParallel",
    "LinearRowParallel",
    "ReduceFromTP",
    "VocabParallelEmbedding",
    "apply_autotp",
    "is_tp_sharded",
    "join_rows",
    "model_tp_size",
    "plan_autotp",
    "replaced_parameters",
    "slice_rows",
    "tp_model_init",
    "vocab_parallel_cross_entropy",
]
