"""Expert parallelism: the expert-parameter marker, its process groups, and a small MoE layer.

A parameter is an *expert parameter* when it carries the attribute :data:`EXPERT_ATTR` (set by
:func:`mark_expert`), whose value is the expert-parallel size ``E``: the experts of a layer are
split over ``E`` consecutive ranks (an *EP group*), each holding ``num_experts / E`` of them.
Ranks holding the same experts form the *expert-data-parallel* (EDP) group
``{j, j + E, j + 2E, ...}``. The ZeRO engine partitions and reduces an expert parameter over
its EDP group, divides its gradient by the full data-parallel world size (every rank's loss
reached it through the all-to-all), and counts it once in the gradient norm. The groups
themselves are made and cached by :func:`ds_core.comm.groups.expert_groups` (re-exported here),
so tearing down ``torch.distributed`` releases them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core.accelerator import get_accelerator
from ds_core.comm.groups import ExpertGroups, expert_groups, reset_expert_groups

#: attribute naming an expert parameter; its value is the expert-parallel size (an int ≥ 1).
EXPERT_ATTR = "ds_expert_parallel_size"
#: attribute of an expert parameter giving its place among the layer's experts:
#: ``(local, num_local, rel)`` — it belongs to local expert ``local`` of the ``num_local`` this
#: rank holds, and ``rel`` is its name inside that expert module. EP rank ``r`` holds global
#: experts ``r · num_local …``; checkpoints name the parameter by its global expert.
EXPERT_INDEX_ATTR = "ds_expert_index"
#: attribute on the root module of a model AutoEP converted (:mod:`ds_core.zero.autoep`): ids of the
#: other ranks' expert parameters it dropped.
DROPPED_ATTR = "ds_autoep_dropped"

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


def mark_expert(param: torch.Tensor, ep_size: int) -> None:
    """Mark ``param`` as an expert parameter split over ``ep_size`` ranks.

    :raises ValueError: when ``ep_size`` is not a positive int.
    """
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    setattr(param, EXPERT_ATTR, ep_size)


def mark_expert_index(expert: nn.Module, local: int, num_local: int) -> None:
    """Record on each parameter of ``expert`` (local expert ``local`` of ``num_local`` on this
    rank, held in a ``ModuleList`` so its parameters are named ``....<local>.<rel>``) where it
    sits, so that checkpoints store it under its global expert index (see
    :data:`EXPERT_INDEX_ATTR`)."""
    for rel, p in expert.named_parameters():
        setattr(p, EXPERT_INDEX_ATTR, (local, num_local, rel))


def dropped_parameters(model: nn.Module) -> set[int]:
    """Ids of the expert parameters AutoEP dropped from ``model`` (other ranks hold them), so
    an optimizer built over the parameters before the conversion still binds, without them."""
    return set(getattr(model, DROPPED_ATTR, ()))


def expert_parallel_size(param: torch.Tensor) -> int | None:
    """The expert-parallel size of an expert parameter, or ``None`` for a dense one."""
    value = getattr(param, EXPERT_ATTR, None)
    return int(value) if value is not None else None


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same exchange reversed."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        get_accelerator().all_to_all(out, x, None, None, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        get_accelerator().all_to_all(out, grad, None, None, ctx.group)
        return None, out


class Expert(nn.Module):
    """One feed-forward expert: ``hidden → ffn → hidden`` with GELU."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class MoE(nn.Module):
    """Top-1 mixture of experts with expert parallelism over ``ep_size`` ranks.

    No token is dropped (each expert's capacity is the whole local batch), so the output does
    not depend on how experts are placed: a layer split over ranks computes what the same
    experts replicated (``ep_size=1``) compute. Meant for tests and examples, not speed.

    :param hidden: model width.
    :param ffn: expert inner width.
    :param num_experts: experts in the layer, a multiple of ``ep_size``.
    :param ep_size: ranks the experts are split over; with more than 1, the world size must be a
        multiple of it and ``torch.distributed`` must be initialised before construction.
    :raises ValueError: when ``num_experts`` is not a multiple of ``ep_size``.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, ep_size: int = 1) -> None:
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of ep_size ({ep_size})"
            )
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local = num_experts // ep_size
        self.ep_rank = expert_groups(ep_size).ep_rank if ep_size > 1 else 0
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(self.num_local))
        for j, expert in enumerate(self.experts):
            mark_expert_index(expert, j, self.num_local)
        for p in self.experts.parameters():
            mark_expert(p, ep_size)

    def global_expert_index(self, local: int) -> int:
        """The layer-wide index of local expert ``local`` on this rank."""
        return self.ep_rank * self.num_local + local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_td = x.reshape(-1, shape[-1])
        probs_te = F.softmax(self.gate(x_td), dim=-1)
        top_t = probs_te.argmax(dim=-1)
        mask_te = F.one_hot(top_t, self.num_experts).to(x.dtype)
        weight_t1 = (probs_te * mask_te).sum(dim=-1, keepdim=True)
        dispatch_etd = mask_te.t().unsqueeze(-1) * x_td.unsqueeze(0)
        if self.ep_size > 1:
            group = expert_groups(self.ep_size).ep_group
            # Received chunk i holds rank i's tokens for this rank's local experts.
            recv: torch.Tensor = _AllToAll.apply(group, dispatch_etd)  # type: ignore[no-untyped-call]
            recv_rltd = recv.view(self.ep_size, self.num_local, *recv.shape[1:])
            outs = [
                self.experts[k](recv_rltd[:, k].reshape(-1, shape[-1])).view(
                    self.ep_size, -1, shape[-1]
                )
                for k in range(self.num_local)
            ]
            out_rltd = torch.stack(outs, dim=1)
            out_etd = _AllToAll.apply(group, out_rltd.reshape(dispatch_etd.shape))  # type: ignore[no-untyped-call]
        else:
            out_etd = torch.stack(
                [self.experts[e](dispatch_etd[e]) for e in range(self.num_experts)]
            )
        combined_td: torch.Tensor = (out_etd * mask_te.t().unsqueeze(-1)).sum(dim=0) * weight_t1
        return combined_td.view(shape)
