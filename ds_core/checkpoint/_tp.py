"""Tensor-parallel shards in checkpoints: gathered to full tensors on save, cut on load.

[Note: TP in checkpoints]
A TP-sharded parameter (see :mod:`ds_core.parallel.tensor`) is stored in the universal format under its
full name with its full (unsharded) shape, exactly as a model without TP stores it, so a
checkpoint does not record, or depend on, the TP size it was saved with. With ``T`` TP ranks
and ``r`` this rank's TP rank:

- **column** (dim 0 split: a Linear's output features, a vocab-parallel embedding's rows): the
  full tensor is the concatenation of the shards along dim 0 — per sub-parameter for a fused
  weight (``[q; k; v]``, equal or of the grouped-query sizes ``(q, kv, kv)``): sub-parameter
  ``i`` of ``n_i`` rows has rank ``r``'s rows ``r·n_i/T … (r+1)·n_i/T`` in rank ``r``'s shard,
  after its earlier sub-parameters' pieces (:func:`ds_core.parallel.tensor.layers.slice_rows`);
- **row** (input features split): concatenation along dim 1;
- every other parameter is replicated over the TP group and taken from TP rank 0.

The same rule holds for the fp32 master, every optimizer state tensor shaped like it (Adam's
moments are elementwise) and frozen weights. A save all-gathers each piece over the TP group
(through the facade's ``all_gather``) after it has been all-gathered over the DP group, one
parameter at a time; a load cuts the full tensor to this rank's TP shard first and then to its
DP piece, so any TP size (1 included) and any DP size and ZeRO stage can load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ds_core.parallel.tensor import TP_ATTR, TP_FUSED_ATTR
from ds_core.parallel.tensor.layers import Fused, join_rows, slice_rows

if TYPE_CHECKING:
    from ds_core.zero.engine import ZeroEngine
    from ds_core.zero.partition import ZeroParam


def tp_size(engine: ZeroEngine) -> int:
    mesh = getattr(engine, "mesh", None)
    return 1 if mesh is None else int(mesh.tp_size)


def tp_rank(engine: ZeroEngine) -> int:
    mesh = getattr(engine, "mesh", None)
    return 0 if mesh is None else int(mesh.tp_rank)


def split_of(engine: ZeroEngine, zp: ZeroParam) -> tuple[str, Fused] | None:
    """``(kind, fused)`` of a TP-sharded parameter on a TP engine, else ``None`` (``fused``: a
    count of equal sub-parameters, or their full sizes; see :data:`ds_core.parallel.tensor.TP_FUSED_ATTR`)."""
    if tp_size(engine) == 1:
        return None
    kind = getattr(zp.param, TP_ATTR, None)
    if kind is None:
        return None
    fused = getattr(zp.param, TP_FUSED_ATTR, 1)
    return str(kind), fused if isinstance(fused, int) else tuple(int(n) for n in fused)


def full_shape(engine: ZeroEngine, zp: ZeroParam) -> torch.Size:
    """The unsharded shape of ``zp`` (its own shape when not TP-sharded)."""
    split = split_of(engine, zp)
    if split is None:
        return torch.Size(zp.shape)
    shape = list(zp.shape)
    shape[0 if split[0] == "column" else 1] *= tp_size(engine)
    return torch.Size(shape)


def gather(engine: ZeroEngine, zp: ZeroParam, local: torch.Tensor) -> torch.Tensor:
    """The full tensor from every TP rank's ``local`` (shaped like ``zp``: this rank's TP shard,
    whole over DP). Collective on the TP group for a sharded parameter; a replicated one is
    returned as it is."""
    split = split_of(engine, zp)
    if split is None:
        return local.reshape(zp.shape)
    kind, fused = split
    t = tp_size(engine)
    local = local.detach().reshape(zp.shape).contiguous()
    out = torch.empty((t, *zp.shape), dtype=local.dtype, device=local.device)
    engine.acc.all_gather(out.view(-1), local.view(-1), engine.mesh.tp_group).wait()
    if kind == "row":  # [t, out, in/t] -> [out, t, in/t] -> [out, in]
        return out.transpose(0, 1).reshape(full_shape(engine, zp))
    return join_rows(list(out), fused).reshape(full_shape(engine, zp))


def cut(engine: ZeroEngine, zp: ZeroParam, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP shard of a full tensor (shaped like ``zp``; a view when possible)."""
    split = split_of(engine, zp)
    if split is None:
        return full.reshape(zp.shape)
    kind, fused = split
    t, r = tp_size(engine), tp_rank(engine)
    full = full.reshape(full_shape(engine, zp))
    if kind == "row":
        return full.chunk(t, dim=1)[r]
    return slice_rows(full, fused, t, r).reshape(zp.shape)
