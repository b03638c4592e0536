"""A test plugin whose asynchronous collectives do their work only when ``wait()`` is called.

Registered over the CPU backend, it turns the comm hookspec's ownership contract into
deterministic failures: an output read before its handle's ``wait()`` holds NaN (or -1 for
integers), and an input modified before it changes the result. Synchronous calls run at once
over ``torch.distributed`` (the facade binds the first implementation directly, so this plugin
answers every call of the four collectives the engine uses). Ranks run the deferred
collectives in the order they wait for them, so the engine must wait in the same order on
every rank — which it must on any backend whose collectives are queued in issue order.
"""

from __future__ import annotations

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

        def run() -> None:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            tmp = input.clone()
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

        def run() -> None:
            rank, n = dist.get_rank(group), input.numel()
            tmp = torch.zeros(output.numel(), dtype=input.dtype, device=input.device)
            tmp[rank * n : (rank + 1) * n].copy_(input.reshape(-1))
            dist.all_reduce(tmp, _OPS["sum"], group=group)
            output.copy_(tmp.view_as(output))

        return self._defer(run, async_op)

    @hookimpl(tryfirst=True)
    def ds_comm_broadcast(
        self, tensor: torch.Tensor, src: int, group: Any, async_op: bool
    ) -> _Deferred:
        return self._defer(lambda: _discard(dist.broadcast(tensor, src, group=group)), async_op)
