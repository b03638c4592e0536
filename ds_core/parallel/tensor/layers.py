"""AutoTP's tensor-parallel layers, the collectives they need and the shard layout helpers
(see :mod:`ds_core.parallel.tensor` for how a model is converted)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core.accelerator import get_accelerator
from ds_core.comm.mesh import Mesh

#: attribute on a tensor-parallel parameter, naming the dimension it is split along (its
#: values differ on each TP rank): ``"column"`` = dim 0 (a Linear's output features, an
#: embedding's vocabulary rows), ``"row"`` = dim 1 (a Linear's input features). Replicated
#: parameters (including a row-parallel layer's bias) lack it.
TP_ATTR = "ds_tensor_parallel"
#: attribute on a column-split parameter holding several sub-parameters along dim 0, each
#: split on its own: their number when equal (``[q; k; v]``: 3, ``[gate; up]``: 2) or their
#: full sizes when not (grouped-query ``[q; k; v]``: ``(q, kv, kv)``); absent means 1.
TP_FUSED_ATTR = "ds_tensor_parallel_fused"

Fused = int | tuple[int, ...]


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


class GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension over the TP group forward (a column-parallel
    layer's output made whole on every rank); backward keeps this rank's slice of the gradient
    (every rank holds the same full output gradient)."""

    @staticmethod
    def forward(ctx: Any, group: Any, tp_size: int, tp_rank: int, x: torch.Tensor) -> torch.Tensor:
        ctx.tp_size, ctx.tp_rank = tp_size, tp_rank
        x = x.contiguous()
        out = torch.empty((tp_size, *x.shape), dtype=x.dtype, device=x.device)
        get_accelerator().all_gather(out.view(-1), x.view(-1), group, False).wait()
        # [t, ..., local] -> [..., t, local] -> [..., t * local]
        return out.movedim(0, -2).reshape(*x.shape[:-1], tp_size * x.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, torch.Tensor]:
        return None, None, None, grad.chunk(ctx.tp_size, dim=-1)[ctx.tp_rank].contiguous()


# --------------------------------------------------------------------------- layers


class LinearColumnParallel(nn.Module):
    """This rank's output slice of a Linear: ``y_local = x · W_localᵀ + b_local``, or with
    ``gather_output`` the whole ``y`` (all-gathered; one sub-parameter only, so the gathered
    columns are in the original order).

    ``in_features`` is the full input width; ``out_features`` the local output width.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mesh: Mesh,
        requires_grad: bool,
        fused: Fused = 1,
        gather_output: bool = False,
        weight_param: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.group = mesh.tp_group
        self.tp_size, self.tp_rank = mesh.tp_size, mesh.tp_rank
        self.gather_output = gather_output
        self.out_features, self.in_features = weight.shape
        # weight_param: the shard already made for a tied embedding (one Parameter, as before)
        self.weight = (
            weight_param
            if weight_param is not None
            else nn.Parameter(weight, requires_grad=requires_grad)
        )
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        for p in (self.weight, self.bias):
            if p is not None:
                setattr(p, TP_ATTR, "column")
                setattr(p, TP_FUSED_ATTR, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        x = CopyToTP.apply(self.group, x)  # type: ignore[no-untyped-call]
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = GatherFromTP.apply(self.group, self.tp_size, self.tp_rank, y)  # type: ignore[no-untyped-call]
        return y

    def extra_repr(self) -> str:
        gathered = ", gather_output" if self.gather_output else ""
        return f"in_features={self.in_features}, out_features={self.out_features} (local){gathered}"


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


def sub_sizes(fused: Fused, rows: int) -> tuple[int, ...]:
    """The sizes along dim 0 of the sub-parameters of a ``rows``-row tensor."""
    return (rows // fused,) * fused if isinstance(fused, int) else tuple(fused)


def slice_rows(t: torch.Tensor, fused: Fused, tp_size: int, tp_rank: int) -> torch.Tensor:
    """``tp_rank``'s rows of the full tensor ``t``: each sub-parameter along dim 0 cut into
    ``tp_size`` equal pieces and this rank's pieces re-fused in order (a view when ``t`` has
    one sub-parameter). Sizes must divide; the caller checks and names the module."""
    parts = torch.split(t, list(sub_sizes(fused, t.shape[0])), dim=0)
    if len(parts) == 1:
        return t.chunk(tp_size, dim=0)[tp_rank]
    return torch.cat([p.chunk(tp_size, dim=0)[tp_rank] for p in parts])


def join_rows(shards: list[torch.Tensor], fused: Fused) -> torch.Tensor:
    """The full tensor from every TP rank's :func:`slice_rows` piece (in TP-rank order)."""
    tp = len(shards)
    local = [n // tp for n in sub_sizes(fused, shards[0].shape[0] * tp)]
    pieces = [torch.split(s, local, dim=0) for s in shards]
    return torch.cat([pieces[r][i] for i in range(len(local)) for r in range(tp)])


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose vocabulary rows are split over the TP group: this rank holds
    rows ``[vocab_start, vocab_start + num_embeddings)``; a token id outside them looks up
    zeros, and the all-reduce of the output sums the one rank's row that holds it.

    ``num_embeddings`` is the local row count. Ids outside ``[0, full vocabulary)`` give a
    zero vector instead of an ``IndexError`` (checking would read the ids on the host).
    """

    def __init__(
        self, weight: torch.Tensor, source: nn.Embedding, mesh: Mesh, requires_grad: bool
    ) -> None:
        super().__init__()
        self.group = mesh.tp_group
        self.tp_size = mesh.tp_size
        self.num_embeddings, self.embedding_dim = weight.shape
        self.vocab_start = mesh.tp_rank * self.num_embeddings
        pad = source.padding_idx
        local_pad = None if pad is None else pad - self.vocab_start
        self.padding_idx = (
            local_pad if local_pad is not None and 0 <= local_pad < len(weight) else None
        )
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        setattr(self.weight, TP_ATTR, "column")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        y = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)  # also keeps row 0's gradient clean
        if self.tp_size > 1:
            y = ReduceFromTP.apply(self.group, y)  # type: ignore[no-untyped-call]
        return y

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (local, from {self.vocab_start}), {self.embedding_dim}"


# --------------------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (fp32): the softmax's max
    and normaliser and the target's logit are reduced over the TP group, the logits never."""

    @staticmethod
    def forward(
        ctx: Any, group: Any, vocab_start: int, logits: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        acc = get_accelerator()
        x = logits.float()
        peak = x.max(dim=-1).values
        acc.all_reduce(peak, "max", group, False).wait()
        x = x - peak.unsqueeze(-1)
        local = targets - vocab_start
        inside = (local >= 0) & (local < x.shape[-1])
        local = local.clamp(0, x.shape[-1] - 1)
        exp = x.exp()
        # one all-reduce for both: the normaliser and the target's logit (held by one rank)
        both = torch.stack([exp.sum(-1), x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside])
        acc.all_reduce(both, "sum", group, False).wait()
        ctx.save_for_backward(exp.div_(both[0].unsqueeze(-1)), local, inside)
        ctx.dtype = logits.dtype
        return both[0].log() - both[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor, None]:
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(g.dtype))
        return None, None, (g * grad.unsqueeze(-1)).to(ctx.dtype), None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, head: nn.Module, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``head``'s logits (``[..., vocab]``, or this rank's
    ``[..., vocab / T]`` when ``head`` is a column-split LM head without ``gather_output``)
    against ``targets`` (``[...]`` token ids; ``ignore_index`` ones left out), without
    gathering the logits. With any other ``head`` (TP off, gathered logits) it is
    ``F.cross_entropy``, so one model code runs at every TP size.
    """
    if not isinstance(head, LinearColumnParallel) or head.tp_size == 1 or head.gather_output:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index
        )
    valid = targets != ignore_index
    start = head.tp_rank * int(head.out_features)
    per_token: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        head.group, start, logits, targets.masked_fill(~valid, 0)
    )
    return (per_token * valid).sum() / valid.sum()
