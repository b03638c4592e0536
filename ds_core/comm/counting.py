"""A wrapper plugin that counts the logical bytes of every collective (docs/architecture.md §3.4).

Register it with :func:`ds_core.register_plugin`; it wraps the ``ds_comm_*`` collective hooks,
so it sees every call the engine makes into the comm layer, whichever plugin implements it.
Bytes are those of the full logical buffer, independent of world size and of how the backend
moves them: all-reduce = 2 × buffer, reduce-scatter = 1 × full input, all-gather = 1 × full
output, broadcast = 1 × buffer, all-to-all = 1 × input; point-to-point: a send = 1 × its
tensor, a receive 0 (its bytes are the sender's), each op of a batch alike. Benchmarks and
tests use it::

    counter = CommCounter()
    ds_core.register_plugin(counter)
    ...  # train
    counter.bytes_by_op()  # {"reduce_scatter": ..., "all_gather": ...}
    ds_core.unregister_plugin(counter)
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ds_core.hookspecs._markers import hookimpl
from ds_core.types import P2POp, Work


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective call.

    :param op: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``, ``"broadcast"``,
        ``"all_to_all"``, ``"barrier"``, ``"send"`` or ``"recv"``.
    :param logical_bytes: bytes counted under the rules in the module docstring.
    :param numel: elements of the buffer the rule counts.
    :param dtype: that buffer's dtype.
    :param async_op: whether the caller asked for an asynchronous handle.
    """

    op: str
    logical_bytes: int
    numel: int
    dtype: torch.dtype | None
    async_op: bool = False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    """Counts collectives and their logical bytes; thread-safe (async handles run elsewhere)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[CommRecord] = []

    def _add(self, op: str, buf: torch.Tensor | None, factor: int, async_op: bool = False) -> None:
        rec = CommRecord(
            op,
            factor * _nbytes(buf) if buf is not None else 0,
            buf.numel() if buf is not None else 0,
            buf.dtype if buf is not None else None,
            async_op,
        )
        with self._lock:
            self.records.append(rec)

    def reset(self) -> None:
        """Forget every record."""
        with self._lock:
            self.records.clear()

    def total_bytes(self, min_numel: int = 0) -> int:
        """Sum of logical bytes of calls whose buffer has at least ``min_numel`` elements.

        ``min_numel`` lets a caller leave out scalar bookkeeping (norms, overflow flags).
        """
        with self._lock:
            return sum(r.logical_bytes for r in self.records if r.numel >= min_numel)

    def bytes_by_op(self, min_numel: int = 0) -> dict[str, int]:
        """Logical bytes per collective name (calls with fewer elements than ``min_numel`` skipped)."""
        out: dict[str, int] = {}
        with self._lock:
            for r in self.records:
                if r.numel >= min_numel:
                    out[r.op] = out.get(r.op, 0) + r.logical_bytes
        return out

    def calls_by_op(self, min_numel: int = 0, async_only: bool = False) -> dict[str, int]:
        """Number of calls per collective name (only asynchronous ones with ``async_only``)."""
        out: dict[str, int] = {}
        with self._lock:
            for r in self.records:
                if r.numel >= min_numel and (r.async_op or not async_only):
                    out[r.op] = out.get(r.op, 0) + 1
        return out

    # -- wrapped hooks -------------------------------------------------------------------

    @hookimpl(wrapper=True)
    def ds_comm_all_reduce(
        self, tensor: torch.Tensor, op: str, group: Any, async_op: bool
    ) -> Generator[None, Work, Work]:
        self._add("all_reduce", tensor, 2, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
    ) -> Generator[None, Work, Work]:
        self._add("reduce_scatter", input, 1, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
    ) -> Generator[None, Work, Work]:
        self._add("all_gather", output, 1, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_broadcast(
        self, tensor: torch.Tensor, src: int, group: Any, async_op: bool
    ) -> Generator[None, Work, Work]:
        self._add("broadcast", tensor, 1, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        group: Any,
        async_op: bool,
    ) -> Generator[None, Work, Work]:
        self._add("all_to_all", input, 1, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_barrier(self, group: Any) -> Generator[None, bool, bool]:
        self._add("barrier", None, 0)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_send(
        self, tensor: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool
    ) -> Generator[None, Work, Work]:
        self._add("send", tensor, 1, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_recv(
        self, tensor: torch.Tensor, src: int, group: Any, tag: int, async_op: bool
    ) -> Generator[None, Work, Work]:
        self._add("recv", tensor, 0, async_op)
        return (yield)

    @hookimpl(wrapper=True)
    def ds_comm_batch_isend_irecv(
        self, ops: list[P2POp]
    ) -> Generator[None, list[Work], list[Work]]:
        for op in ops:
            self._add(op.op, op.tensor, 1 if op.op == "send" else 0, True)
        return (yield)
