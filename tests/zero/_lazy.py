"""A test plugin whose asynchronous collectives do their work only when ``wait()`` is called.

Registered over the CPU backend, it turns the comm hookspec's ownership contract into
deterministic failures: an output read before its handle's ``wait()`` holds NaN (or -1 for
integers), an input modified before it changes the result, and an input the caller released
before it (no reference left: the memory could be reused) fails the ``wait()`` naming the
collective. Synchronous calls run at once
over ``torch.distributed`` (the facade binds the first implementation directly, so this plugin
answers every call of the four collectives the engine uses). Ranks run the deferred
collectives in the order they wait for them, so the engine must wait in the same order on
every rank — which it must on any backend whose collectives are queued in issue order.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ds_core import hookimpl

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else -1)


def _discard(_: object) -> None:
    return None


def _held(t: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
    """A weak hold on a collective's input: the deferred work reads it through this, so it
    keeps nothing alive itself, and a caller that dropped every reference before ``wait()``
    (the memory of a device tensor could be reused by then) is caught. A view is held by its
    base, which owns the memory."""
    ref = weakref.ref(t._base if t._base is not None else t)
    shape, stride, offset = t.shape, t.stride(), t.storage_offset()

    def get() -> torch.Tensor:
        base = ref()
        if base is None:
            raise RuntimeError(
                f"the input of an asynchronous {name} was released before its wait(); the "
                "caller must keep it alive until then (ds_core/hookspecs/comm.py)"
            )
        return base.as_strided(shape, stride, offset)

    return get


class _Deferred:
    def __init__(self, run: Callable[[], None]) -> None:
        self._run: Callable[[], None] | None = run

    def wait(self) -> bool:
        if self._run is not None:
            run, self._run = self._run, None
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


class LazyCollectives:
    """Defers every asynchronous collective to its ``wait()``; counts how many it deferred."""

    def __init__(self) -> None:
        self.deferred = 0

    def _defer(self, run: Callable[[], None], async_op: bool) -> _Deferred:
        handle = _Deferred(run)
        if async_op:
            self.deferred += 1
        else:
            handle.wait()
        return handle

    @hookimpl(tryfirst=True)
    def ds_comm_all_reduce(
        self, tensor: torch.Tensor, op: str, group: Any, async_op: bool
    ) -> _Deferred:

        def run() -> None:
            dist.all_reduce(tensor, _OPS["sum" if op == "avg" else op], group=group)
            if op == "avg":
                tensor.div_(dist.get_world_size(group))

        return self._defer(run, async_op)

    @hookimpl(tryfirst=True)
    def ds_comm_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
    ) -> _Deferred:
        if async_op:
            _poison(output)
        source = _held(input, "reduce_scatter")
        del input

        def run() -> None:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            tmp = source().clone()
            dist.all_reduce(tmp, _OPS["sum" if op == "avg" else op], group=group)
            mine = tmp.view(world, -1)[rank]
            output.copy_(mine / world if op == "avg" else mine)

        return self._defer(run, async_op)

    @hookimpl(tryfirst=True)
    def ds_comm_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
    ) -> _Deferred:
        if async_op:
            _poison(output)
        source = _held(input, "all_gather")
        del input

        def run() -> None:
            src = source()
            rank, n = dist.get_rank(group), src.numel()
            tmp = torch.zeros(output.numel(), dtype=src.dtype, device=src.device)
            tmp[rank * n : (rank + 1) * n].copy_(src.reshape(-1))
            dist.all_reduce(tmp, _OPS["sum"], group=group)
            output.copy_(tmp.view_as(output))

        return self._defer(run, async_op)

    @hookimpl(tryfirst=True)
    def ds_comm_broadcast(
        self, tensor: torch.Tensor, src: int, group: Any, async_op: bool
    ) -> _Deferred:
        return self._defer(lambda: _discard(dist.broadcast(tensor, src, group=group)), async_op)
