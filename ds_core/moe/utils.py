"""``deepspeed.moe.utils``: telling expert parameters apart and giving them their own optimizer
groups, with DeepSpeed 0.19.8's semantics.

An expert parameter is one DeepSpeed marks ``allreduce = False`` (its :class:`~ds_core.moe.layer.MoE`
does, and names its expert group in ``group_name``), or one ds_core marks with
:data:`~ds_core.parallel.expert.moe.EXPERT_ATTR` (:class:`ds_core.moe.MoE`, AutoEP); the group
name of the latter is DeepSpeed's ``ep_size_<E>``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ds_core.moe.layer import MoE as DeepSpeedMoE
from ds_core.parallel.expert.moe import EXPERT_ATTR, MoE

__all__ = [
    "expert_group_name",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]

#: DeepSpeed's default ``max_group_size``: elements per optimizer group at most.
MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (is reduced over its expert-data-parallel group)."""
    if hasattr(param, "allreduce") and not param.allreduce:
        return True
    return getattr(param, EXPERT_ATTR, None) is not None


def expert_group_name(param: torch.Tensor) -> str:
    """The expert group an expert parameter belongs to (DeepSpeed's ``param.group_name``)."""
    name = getattr(param, "group_name", None)
    if name is not None:
        return str(name)
    return f"ep_size_{getattr(param, EXPERT_ATTR)}"


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` when ``model`` holds one, else ``(False, 0)``."""
    for module in model.modules():
        if isinstance(module, (MoE, DeepSpeedMoE)):
            return True, int(module.num_experts)
    return False, 0


def split_params_into_shared_and_expert_params(
    params: list[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(shared, expert)`` parameters of ``params``, each in the given order."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether an optimizer group is one of the expert groups made below."""
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Move expert parameters out of their optimizer groups into groups of their own.

    Each group must have a ``name``. For every group and every expert group name found among the
    parameters, a new group copies the original's options with ``name`` set to the expert
    group's name and ``moe: True``; it holds that group's expert parameters in their order,
    split into consecutive chunks of at most ``max_group_size`` elements (one group per chunk;
    ``None``: no split). The original groups keep their other parameters, in place, and the
    expert groups follow them. A dict or tuple is taken as a list; a list is edited in place
    and returned, as DeepSpeed does.

    :raises ValueError: when ``param_groups`` is neither a dict, a tuple nor a list.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")

    names = sorted(
        {expert_group_name(p) for g in param_groups for p in g["params"] if is_moe_param(p)}
    )
    # DeepSpeed iterates a set of names; sorting makes the order reproducible across ranks.
    moe: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for group in param_groups:
        for name in names:
            moe[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        kept = []
        for p in group["params"]:
            if is_moe_param(p):
                moe[group["name"]][expert_group_name(p)]["params"].append(p)
            else:
                kept.append(p)
        group["params"] = kept

    for by_name in moe.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            chunks: list[list[torch.Tensor]] = []
            chunk: list[torch.Tensor] = []
            size = 0
            for p in group["params"]:
                numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                if size + numel <= max_group_size:
                    chunk.append(p)
                    size += numel
                else:
                    chunks.append(chunk)
                    chunk, size = [p], numel
            if chunk:
                chunks.append(chunk)
            param_groups.extend({**group, "params": c} for c in chunks)
    return param_groups
