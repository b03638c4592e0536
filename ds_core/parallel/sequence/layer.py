"""Ulysses attention: :class:`DistributedAttention` and the all-to-all it is built on.

The facts follow DeepSpeed 0.19.8's ``sequence/layer.py``: each rank of a sequence-parallel
(SP) group of ``P`` ranks holds ``1/P`` of every sequence (the contiguous positions
``[r·T/P, (r+1)·T/P)`` on SP rank ``r``) with all ``H`` heads. Before the local attention an
all-to-all trades that for the whole sequence and ``H/P`` heads (heads
``[r·H/P, (r+1)·H/P)`` on rank ``r``), so the unmodified local attention sees every position
it attends over; after it, the inverse all-to-all gives each rank its positions back with
every head. Attention is independent per head, so the result equals attention over the full
sequence in one process.

The exchange is an autograd function whose backward is the inverse exchange (the gradient of
a permutation of data between ranks is the inverse permutation of the gradient). It runs on
the accelerator facade's ``all_to_all`` (the comm hooks, docs/architecture.md §9.4), so byte
counters and backend overrides see it (§3.4 counts it as 1 × input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_core.accelerator import get_accelerator
from ds_core.comm.groups import get_world_size

__all__ = ["DistributedAttention", "seq_all_to_all"]


def _exchange(x: torch.Tensor, group: Any, size: int, scatter: int, gather: int) -> torch.Tensor:
    """Split ``x`` into ``size`` chunks along ``scatter``, send chunk ``j`` to rank ``j`` and
    concatenate the chunks received, in rank order, along ``gather``."""
    # Chunk j leads dim 0 so the equal-split all-to-all (dim-0 slices) sends it to rank j.
    send = torch.stack(x.chunk(size, dim=scatter))
    recv = torch.empty_like(send)
    get_accelerator().all_to_all(recv, send, None, None, group)
    return torch.cat(recv.unbind(0), dim=gather)


class _SeqAllToAll(torch.autograd.Function):
    """:func:`_exchange` forward; backward exchanges the gradient with the two dims swapped."""

    @staticmethod
    def forward(
        ctx: Any, group: Any, size: int, x: torch.Tensor, scatter: int, gather: int
    ) -> torch.Tensor:
        ctx.group, ctx.size, ctx.scatter, ctx.gather = group, size, scatter, gather
        return _exchange(x, group, size, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor, None, None]:
        # Not _SeqAllToAll.apply: nobody differentiates twice through an exchange here, and
        # one autograd node less per call is cheaper.
        return None, None, _exchange(grad, ctx.group, ctx.size, ctx.gather, ctx.scatter), None, None


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_idx: int, gather_idx: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: scatter ``x`` along ``scatter_idx`` (``P``
    equal chunks, chunk ``j`` to rank ``j``), gather along ``gather_idx`` in rank order.

    ``scatter_idx`` = heads, ``gather_idx`` = sequence turns sequence shards into head shards;
    swapped, it turns them back. Its backward is the swapped exchange. Every rank of ``group``
    must call it with tensors of the same shape.

    :param x: the tensor; ``x.shape[scatter_idx]`` must be a multiple of the group's size.
    :param group: a process group from :mod:`ds_core.comm` (the mesh's ``sp_group``);
        ``None`` is every rank, as everywhere in :mod:`ds_core.comm`.
    :param scatter_idx: the dimension split between ranks.
    :param gather_idx: the dimension the received chunks are joined along.
    :returns: ``x`` itself when the group has one rank, else the exchanged tensor (the
        ``scatter_idx`` dimension ``P`` times smaller, ``gather_idx`` ``P`` times larger).
    :raises ValueError: when the group's size does not divide ``x.shape[scatter_idx]``, or the
        two dimensions are equal or out of range.
    """
    size = get_world_size(group)
    nd = x.dim()
    if not (-nd <= scatter_idx < nd and -nd <= gather_idx < nd):
        raise ValueError(
            f"scatter_idx {scatter_idx} / gather_idx {gather_idx} out of range for a "
            f"{nd}-dimensional tensor"
        )
    scatter, gather = scatter_idx % nd, gather_idx % nd
    if scatter == gather:
        raise ValueError(f"scatter_idx and gather_idx are both dimension {scatter}")
    if size == 1:
        return x
    if x.shape[scatter] % size:
        raise ValueError(
            f"the sequence parallel size {size} does not divide dimension {scatter} of size "
            f"{x.shape[scatter]}; choose a sequence_parallel_size that divides it"
        )
    out: torch.Tensor = _SeqAllToAll.apply(group, size, x, scatter, gather)  # type: ignore[no-untyped-call]
    return out


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` features of ``t`` (the rest pass)."""
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    out = head * cos + _rotate_half(head) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class DistributedAttention(nn.Module):
    """Ulysses sequence-parallel attention around an unmodified local attention
    (DeepSpeed 0.19.8's ``deepspeed.sequence.layer.DistributedAttention``, same arguments).

    ``forward(query, key, value, batch_dim_idx)`` takes this rank's sequence shard of 4-D
    tensors laid out ``[batch, seq/P, heads, head_dim]`` (``batch_dim_idx=0``) or
    ``[seq/P, batch, heads, head_dim]`` (``batch_dim_idx=1``), exchanges them into
    ``[..., seq, heads/P, head_dim]`` (the full sequence, this rank's heads), calls
    ``local_attention(q, k, v, *args, **kwargs)`` on those, and exchanges its output (same
    layout) back into this rank's shard with every head. Queries and keys/values may have
    different head counts (grouped-query attention): each is split into ``P`` contiguous
    blocks, which keeps a query head with its key/value head when ``P`` divides both counts.

    :param local_attention: the attention over the full sequence, called on head shards.
    :param sequence_process_group: the SP group (``engine.mesh.sp_group``,
        ``ds_core.utils.groups._get_sequence_parallel_group()``); ``None`` is every rank.
    :param scatter_idx: the heads dimension (DeepSpeed's default 2).
    :param gather_idx: kept for DeepSpeed's signature: as in DeepSpeed 0.19.8, the sequence
        dimension comes from ``batch_dim_idx`` (the other of dimensions 0 and 1), so its
        default 0 serves both layouts.
    :param sp_stream: accepted for DeepSpeed's signature; ds_core does not overlap the
        exchanges with computation (the result is the same, the exchanges run in order on the
        current stream).
    :param num_kv_heads: the key/value head count, checked against the SP size when given
        (DeepSpeed's uneven head split, for counts ``P`` does not divide, is not supported).
    :raises ValueError: from ``forward``, when the SP size does not divide a tensor's head count
        (the message names both and the fix), or the layout is not one of the two above.
    """

    def __init__(
        self,
        local_attention: nn.Module,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def _check(self, name: str, t: torch.Tensor, size: int, batch_dim_idx: int) -> None:
        if t.dim() != 4:
            raise ValueError(
                f"DistributedAttention: {name} must be 4-D ([batch, seq, heads, head_dim] or "
                f"[seq, batch, heads, head_dim]), got shape {tuple(t.shape)}"
            )
        if self.scatter_idx % 4 in (0, 1):
            raise ValueError(
                f"DistributedAttention: scatter_idx {self.scatter_idx} must name the heads "
                "dimension (2 or 3), not the batch or sequence one"
            )
        heads = t.shape[self.scatter_idx]
        if heads % size:
            raise ValueError(
                f"sequence parallel size {size} does not divide the {heads} attention heads of "
                f"the {name}; choose a sequence_parallel_size that divides the number of heads "
                "(of queries and of keys/values)"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of this rank's sequence shard over the whole sequence.

        :param query: ``[batch, seq/P, heads, head_dim]`` (or sequence first, see the class).
        :param key: the same layout (its head count may differ: grouped-query attention).
        :param value: the same layout as ``key``.
        :param batch_dim_idx: 0 (batch first) or 1 (sequence first).
        :param rotary_pos_emb: ``(cos, sin)`` applied to the exchanged query and key as
            DeepSpeed 0.19.8 does: each permuted with ``(1, 0, 2, 3)``, then
            ``t·cos + rotate_half(t)·sin`` on the first ``cos.shape[-1]`` features.
        :param args: passed to the local attention after ``q, k, v``.
        :param kwargs: passed to the local attention.
        :returns: the attention output for this rank's shard, ``[batch, seq/P, heads, dim]``
            (or sequence first), with ``dim`` the local attention's output width per head.
        :raises ValueError: see the class.
        """
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 or 1, got {batch_dim_idx}")
        size = get_world_size(self.spg)
        seq = 1 - batch_dim_idx
        if self.num_kv_heads is not None and self.num_kv_heads % size:
            raise ValueError(
                f"sequence parallel size {size} does not divide num_kv_heads "
                f"{self.num_kv_heads}; choose a sequence_parallel_size that divides it"
            )
        for name, t in (("query", query), ("key", key), ("value", value)):
            self._check(name, t, size, batch_dim_idx)
        heads = self.scatter_idx
        q, k, v = (seq_all_to_all(t, self.spg, heads, seq) for t in (query, key, value))
        if rotary_pos_emb is not None:
            cos, sin = (r.permute(1, 0, 2, 3) for r in rotary_pos_emb)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, seq, heads)
