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
from ds_core.types import P2POp, Work


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


# -- point-to-point: backends declaring "p2p" (ds_core/hookspecs/comm.py, Point-to-point) ------


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst``; may return before ``dst`` received it.

    :raises NotSupportedError: when the backend lacks ``p2p``.
    :raises ValueError: when ``dst`` is this rank or not a rank of the world.
    :raises RuntimeError: naming ``dst`` when it has exited.
    """
    get_accelerator().send(tensor, dst, group, tag, False)


def recv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> None:
    """Receive into ``tensor`` what global rank ``src`` sends (its size and dtype).

    :raises NotSupportedError: when the backend lacks ``p2p``.
    :raises ValueError: when ``src`` is this rank or not a rank of the world.
    :raises RuntimeError: naming ``src`` when it has exited.
    """
    get_accelerator().recv(tensor, src, group, tag, False)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Work:
    """Start sending ``tensor`` to ``dst``; keep it unmodified until the handle's ``wait()``."""
    return get_accelerator().send(tensor, dst, group, tag, True)


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Work:
    """Start receiving into ``tensor`` from ``src``; ``wait()`` makes the data visible."""
    return get_accelerator().recv(tensor, src, group, tag, True)


def batch_isend_irecv(ops: list[P2POp]) -> list[Work]:
    """Start every operation of ``ops`` (:class:`~ds_core.types.P2POp`) before waiting for
    any; a handle per op, in order. Use it whenever two ranks both send and receive.

    :raises NotSupportedError: when the backend lacks ``p2p``.
    :raises ValueError: when ``ops`` is empty, mixes groups or names this rank as a peer.
    """
    return get_accelerator().batch_isend_irecv(ops)
