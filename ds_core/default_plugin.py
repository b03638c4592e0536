"""The core's default plugins: collectives over ``torch.distributed``, profiler ranges.

:class:`DefaultCollectives` and :class:`DefaultProfiler` are registered ``trylast`` next to the selected backend (see
:func:`ds_core.accelerator.build_accelerator`), so a backend overrides a collective only where its
process-group library lacks it or does better another way. It uses ``torch.distributed`` and
nothing else from ds_core but the hook markers and types: the selection layer imports it, and
process groups (:mod:`ds_core.comm`) sit above the selection layer, so it lives outside that
package.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_core.comm_staging import require_contiguous
from ds_core.errors import DSCoreError
from ds_core.hookspecs._markers import hookimpl
from ds_core.types import COMPLETED, REDUCE_OPS, P2POp, Work

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


def _member(work: Any, what: str) -> Work:
    """``work``, or an error when torch returned none: this rank is not in the group."""
    if work is None:
        raise ValueError(f"{what}: this rank is not a member of the group it passed")
    handle: Work = work
    return handle


def _check_numel(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise ValueError(f"{what} has {got} elements, expected {expected}")


class DefaultCollectives:
    """Collective hooks over ``torch.distributed`` (registered ``trylast`` by the core).

    ``"avg"`` is a sum followed by a division, because not every process-group library
    implements an average reduction. Each raises ``ValueError`` on a non-contiguous tensor:
    the facade never passes one (:mod:`ds_core.comm_staging`), and ``torch.distributed``
    would read or write the wrong elements of some (an all-reduce of a column).
    """

    @hookimpl(trylast=True)
    def ds_comm_all_reduce(self, tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
        require_contiguous("all_reduce", tensor=tensor)
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
        require_contiguous("all_gather", output=output, input=input)
        _check_numel(
            "all_gather output", output.numel(), input.numel() * dist.get_world_size(group)
        )
        # Flat views: the contract sizes output by element count, and some libraries (gloo)
        # refuse an output whose shape is not input's concatenated along dim 0.
        work = _all_gather_single(output.view(-1), input.view(-1), group=group, async_op=async_op)
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
    ) -> Work:
        require_contiguous("reduce_scatter", output=output, input=input)
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
        require_contiguous("broadcast", tensor=tensor)
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
        require_contiguous("all_to_all", output=output, input=input)
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
        return _finish(work, async_op)

    @hookimpl(trylast=True)
    def ds_comm_barrier(self, group: Any) -> bool:
        dist.barrier(group=group)
        return True

    @hookimpl(trylast=True)
    def ds_comm_send(
        self, tensor: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool
    ) -> Work:
        require_contiguous("send", tensor=tensor)
        if async_op:
            return _member(dist.isend(tensor, dst, group=group, tag=tag), "send")
        dist.send(tensor, dst, group=group, tag=tag)
        return COMPLETED

    @hookimpl(trylast=True)
    def ds_comm_recv(
        self, tensor: torch.Tensor, src: int, group: Any, tag: int, async_op: bool
    ) -> Work:
        require_contiguous("recv", tensor=tensor)
        if async_op:
            return _member(dist.irecv(tensor, src, group=group, tag=tag), "recv")
        dist.recv(tensor, src, group=group, tag=tag)
        return COMPLETED

    @hookimpl(trylast=True)
    def ds_comm_batch_isend_irecv(self, ops: list[P2POp]) -> list[Work]:
        for op in ops:
            require_contiguous(f"batch_isend_irecv {op.op}", tensor=op.tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(
                    dist.isend if op.op == "send" else dist.irecv,
                    op.tensor,
                    op.peer,
                    op.group,
                    op.tag,
                )
                for op in ops
            ]
        )
        return [_member(w, "batch_isend_irecv") for w in works]


class DefaultProfiler:
    """Profiler ranges as ``torch.profiler.record_function`` ranges (registered ``trylast``).

    ``torch.profiler`` records them on every device type; a backend whose vendor profiler has
    its own range API implements the profiler hooks to reach it.
    """

    def __init__(self) -> None:
        self._open: list[Any] = []

    @hookimpl(trylast=True)
    def ds_profiler_range_push(self, msg: str) -> bool:
        ctx = torch.autograd.profiler.record_function(msg)
        ctx.__enter__()  # type: ignore[no-untyped-call]
        self._open.append(ctx)
        return True

    @hookimpl(trylast=True)
    def ds_profiler_range_pop(self) -> bool:
        if not self._open:
            raise DSCoreError("range_pop() without a matching range_push()")
        self._open.pop().__exit__(None, None, None)
        return True
