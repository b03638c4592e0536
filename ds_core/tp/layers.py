"""AutoTP's tensor-parallel layers, the collectives they need and the shard layout helpers
(see :mod:`ds_core.tp` for how a model is converted)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core.accelerator import get_accelerator
from ds_core.comm.mesh import Mesh

#: attribute on a tensor-parallel parameter: ``"column"`` or ``"row"`` (its values differ on
#: each TP rank). Replicated parameters (including a row-parallel layer's bias) lack it.
TP_ATTR = "ds_tensor_parallel"
#: attribute on a column-parallel parameter of a fused weight: its number of equal
#: sub-parameters along dim 0 (``[q; k; v]``: 3), each split separately; absent means 1.
TP_FUSED_ATTR = "ds_tensor_parallel_fused"


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` holds a tensor-parallel shard (differs on each TP rank)."""
    return getattr(param, TP_ATTR, None) is not None


# --------------------------------------------------------------------------- collectives


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    out = t.contiguous().clone()
    get_accelerator().all_reduce(out, "sum", group, False).wait()
    return out


class CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient is all-reduced over the TP group (a column-parallel
    layer's input: each rank's partial input gradient becomes the full one)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _all_reduce(grad, ctx.group)


class ReduceFromTP(torch.autograd.Function):
    """All-reduce over the TP group forward (a row-parallel layer's partial outputs); the
    gradient passes through unchanged (every rank's output gradient is already the full one)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


# --------------------------------------------------------------------------- layers


class LinearColumnParallel(nn.Module):
    """This rank's output slice of a Linear: ``y_local = x · W_localᵀ + b_local``.

    ``in_features`` is the full input width; ``out_features`` the local output width.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mesh: Mesh,
        requires_grad: bool,
        fused: int = 1,
    ) -> None:
        super().__init__()
        self.group = mesh.tp_group
        self.tp_size = mesh.tp_size
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        for p in (self.weight, self.bias):
            if p is not None:
                setattr(p, TP_ATTR, "column")
                setattr(p, TP_FUSED_ATTR, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            x = CopyToTP.apply(self.group, x)  # type: ignore[no-untyped-call]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local)"


class LinearRowParallel(nn.Module):
    """A Linear over this rank's input slice, partial outputs summed over the TP group, then
    the whole (replicated) bias added once. ``in_features`` is the local input width."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: Mesh, requires_grad: bool
    ) -> None:
        super().__init__()
        self.group = mesh.tp_group
        self.tp_size = mesh.tp_size
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        setattr(self.weight, TP_ATTR, "row")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            y = ReduceFromTP.apply(self.group, y)  # type: ignore[no-untyped-call]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}"


def slice_rows(t: torch.Tensor, fused: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    sub = t.reshape(fused, t.shape[0] // fused, *t.shape[1:])
    piece = sub.chunk(tp_size, dim=1)[tp_rank]
    return piece.reshape(-1, *t.shape[1:]).clone()
