"""The collectives as functions: each calls the selected accelerator's comm hook.

``ds_core.comm.all_reduce(t)`` is ``get_accelerator().all_reduce(t)``: the same hook, the same
binding (direct, or through pluggy when a wrapper plugin such as
:class:`~ds_core.comm.counting.CommCounter` is registered), spelled the way
``torch.distributed`` users expect. Tensors live on the accelerator's device; groups come from
:func:`ds_core.comm.new_group` (``None`` = every rank). Every call returns a handle with
``wait()``, already complete unless ``async_op`` is true.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.types import Work


def all_reduce(
    tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False
) -> Work:
    """Reduce ``tensor`` in place across ``group``; ``op`` is one of sum, avg, max, min, product.

    :raises ValueError: on an unknown ``op``.
    """
    return get_accelerator().all_reduce(tensor, op, group, async_op)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Work:
    """Gather each rank's ``input`` into ``output`` (concatenated along dim 0).

    :raises ValueError: when ``output`` is not ``world`` times the size of ``input``.
    """
    return get_accelerator().all_gather(output, input, group, async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "sum",
    group: Any = None,
    async_op: bool = False,
) -> Work:
    """Reduce ``input`` across ranks; rank r keeps chunk r (of ``world`` equal chunks) in ``output``.

    :raises ValueError: when ``input`` is not ``world`` times the size of ``output``.
    """
    return get_accelerator().reduce_scatter(output, input, op, group, async_op)


def broadcast(
    tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False
) -> Work:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
    return get_accelerator().broadcast(tensor, src, group, async_op)


def barrier(group: Any = None) -> bool:
    """Block until every rank of ``group`` arrives."""
    return get_accelerator().barrier(group)
