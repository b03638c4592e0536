"""DeepSpeed's ``deepspeed.moe`` path; the implementation is :mod:`ds_core.parallel.expert.moe`.

:mod:`ds_core.moe.layer` holds ``MoE`` with DeepSpeed's constructor and return value, and
:mod:`ds_core.moe.utils` DeepSpeed's helpers for expert parameters and optimizer groups.
"""

from __future__ import annotations

from ds_core.parallel.expert.moe import (
    DROPPED_ATTR,
    EXPERT_ATTR,
    EXPERT_INDEX_ATTR,
    Expert,
    ExpertGroups,
    MoE,
    dropped_parameters,
    expert_groups,
    expert_parallel_size,
    mark_expert,
    mark_expert_index,
    reset_expert_groups,
)

__all__ = [
    "DROPPED_ATTR",
    "EXPERT_ATTR",
    "EXPERT_INDEX_ATTR",
    "Expert",
    "ExpertGroups",
    "MoE",
    "dropped_parameters",
    "expert_groups",
    "expert_parallel_size",
    "mark_expert",
    "mark_expert_index",
    "reset_expert_groups",
]
