"""Process groups and collectives over the comm hooks.

The engine calls these functions, never ``torch.distributed`` collectives directly, so every
byte it moves passes through the comm hooks (and any wrapper plugin counting them). The core's
default plugin, :class:`DefaultCollectives`, implements the collective hooks over
``torch.distributed`` with whatever the installed torch offers; a backend overrides one only
where its library lacks it or does better another way.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from ds_core.hookspecs._markers import hookimpl
from ds_core.types import COMPLETED, REDUCE_OPS, Work

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torch_reduce_op(op: str) -> Any:
    """The ``torch.distributed.ReduceOp`` for ``op`` (``"avg"`` is handled by the caller)."""
    try:
        return _TORCH_OPS[op]
    except KeyError:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}") from None


class _DivideOnWait:
    """Handle that finishes an average: sum across ranks, then divide in place on wait()."""

    __slots__ = ("_done", "_n", "_tensor", "_work")

    def __init__(self, work: Any, tensor: torch.Tensor, n: int) -> None:
        self._work, self._tensor, self._n, self._done = work, tensor, n, False

    def wait(self) -> bool:
        if not self._done:
            self._work.wait()
            self._tensor.div_(self._n)
            self._done = True
        return True


def _finish(work: Any, async_op: bool) -> Work:
    if async_op:
        handle: Work = work
        return handle
    return COMPLETED


def _check_numel(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise ValueError(f"{what} has {got} elements, expected {expected}")


class DefaultCollectives:
    """Collective hooks over ``torch.distributed`` (registered ``trylast`` by the core).

    ``"avg"`` is a sum followed by a division, because not every process-group library
    implements an average reduction.
    """

    @hookimpl(trylast=True)
    def ds_comm_all_reduce(self, tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
        if op == "avg":
            work = dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group, async_op=True)
            handle = _DivideOnWait(work, tensor, dist.get_world_size(group))
            if not async_op:
                handle.wait()
                return COMPLETED
            return handle
        work = dist.all_reduce(tensor, torch_reduce_op(op), group=group, async_op=async_op)
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
    ) -> Work:
        _check_numel(
            "all_gather output", output.numel(), input.numel() * dist.get_world_size(group)
        )
        work = _all_gather_single(output, input, group=group, async_op=async_op)
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
    ) -> Work:
        world = dist.get_world_size(group)
        _check_numel("reduce_scatter input", input.numel(), output.numel() * world)
        if op == "avg":
            work = _reduce_scatter_single(
                output, input, dist.ReduceOp.SUM, group=group, async_op=True
            )
            handle = _DivideOnWait(work, output, world)
            if not async_op:
                handle.wait()
                return COMPLETED
            return handle
        work = _reduce_scatter_single(
            output, input, torch_reduce_op(op), group=group, async_op=async_op
        )
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_broadcast(self, tensor: torch.Tensor, src: int, group: Any, async_op: bool) -> Work:
        work = dist.broadcast(tensor, src, group=group, async_op=async_op)
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        group: Any,
        async_op: bool,
    ) -> Work:
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_barrier(self, group: Any) -> bool:
        dist.barrier(group=group)
        return True


# --------------------------------------------------------------------------- process groups


def init_distributed(
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
) -> None:
    """Initialise ``torch.distributed`` with the selected backend's comm name.

    Reads the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK``); with none of it set, starts a one-process group on a
    free loopback port, so single-process scripts work unchanged. Sets the current device to
    ``LOCAL_RANK``. Idempotent.

    :param timeout: seconds (or a timedelta) after which a collective that a dead rank never
        joins fails on the others, instead of hanging. Default: torch's (10 minutes).
    :param init_method: a ``torch.distributed`` init method URL; default ``env://``.
    :raises RuntimeError: when the comm library cannot be prepared.
    """
    from ds_core.accelerator import get_accelerator

    if dist.is_available() and dist.is_initialized():
        return
    acc = get_accelerator()
    acc.prepare_communication()
    if "RANK" not in os.environ and init_method is None:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    kwargs: dict[str, Any] = {"backend": acc.communication_backend_name()}
    if timeout is not None:
        kwargs["timeout"] = (
            timeout
            if isinstance(timeout, datetime.timedelta)
            else datetime.timedelta(seconds=timeout)
        )
    kwargs["init_method"] = init_method or "env://"
    dist.init_process_group(**kwargs)
    atexit.register(destroy_distributed)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank < acc.device_count():
        acc.set_device(local_rank)


def destroy_distributed() -> None:
    """Release ds_core's cached process groups and destroy ``torch.distributed``'s.

    Safe to call twice, or after ``torch.distributed.destroy_process_group()``.
    ``init_distributed`` registers it to run at exit: a process-group object that outlives
    ``destroy_process_group`` (held by a cache, or by a module in a reference cycle) is
    otherwise destroyed during interpreter finalization, where gloo's worker threads abort the
    process ("terminate called without an active exception", seen with torch 2.13).
    """
    from ds_core import moe

    moe.reset_expert_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def new_group(ranks: list[int] | None = None) -> Any:
    """Create a process group over ``ranks`` (all ranks when ``None``) with the comm backend.

    Every rank must call it with the same ``ranks``, as ``torch.distributed.new_group`` requires.
    """
    from ds_core.accelerator import get_accelerator

    return dist.new_group(ranks, backend=get_accelerator().communication_backend_name())


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 when distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (1 when distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1
