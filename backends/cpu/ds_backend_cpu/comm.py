"""The CPU backend's collective hooks: shared memory within a host, gloo otherwise.

Each call picks its transport (:func:`route`): the shared-memory transport of
:mod:`ds_backend_cpu.shm` when the group's ranks all share this host and the tensors are
host tensors of a dtype it handles, else gloo. Tensors are contiguous on either path: the
facade stages non-contiguous views (:mod:`ds_core.comm_staging`), and a hook called directly
with one raises ``ValueError``, because gloo would reduce the wrong elements of some. The choice is counted per collective
and reason (:func:`transport_counts`), and a gloo call on a group with queued shared-memory
calls first waits for them, so calls on a group keep their order whatever carries them.

Two measured facts about gloo shape its path (``bench/cpu_collectives.py``):
- its native reduce-scatter and all-gather each take longer than an all-reduce of the whole
  buffer, so both run as an in-place all-reduce; bool tensors keep the native all-gather;
- it has no int16 collectives ("Invalid scalar type"), so int16 tensors travel as int32 and
  are narrowed on arrival. That is exact: narrowing wraps modulo 2**16 as int16 sums do.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_cpu import shm, shm_groups
from ds_core import hookimpl
from ds_core.comm import DefaultCollectives, torch_reduce_op
from ds_core.comm_staging import require_contiguous
from ds_core.types import COMPLETED, REDUCE_OPS, Work

_counts: Counter[tuple[str, str, str]] = Counter()
_counts_lock = threading.Lock()


def transport_counts() -> dict[tuple[str, str, str], int]:
    """Calls so far in this process by ``(collective, "shm" | "gloo", reason for gloo)``."""
    with _counts_lock:
        return dict(_counts)


def _count(collective: str, transport: str, reason: str) -> None:
    with _counts_lock:
        _counts[(collective, transport, reason)] += 1


def _tensor_reason(tensors: Sequence[torch.Tensor]) -> str:
    for t in tensors:
        if t.device.type != "cpu":
            return f"tensor on {t.device}"
        if t.layout != torch.strided:
            return f"{t.layout} tensor"
        if t.dtype not in shm.DTYPES:
            return f"dtype {t.dtype}"
    return ""


#: Set to 1 to make any fallback to gloo an error (single-rank groups excepted): CI uses it to
#: prove that a suite ran on shared memory.
ENV_REQUIRE = "DS_CPU_SHM_REQUIRE"


def _gloo(collective: str, reason: str) -> None:
    if reason != shm_groups.SINGLE_RANK and os.environ.get(ENV_REQUIRE, "") == "1":
        raise RuntimeError(
            f"{collective} would fall back to gloo ({reason}), and {ENV_REQUIRE}=1 forbids it"
        )
    _count(collective, "gloo", reason)


def route(
    collective: str, group: Any, tensors: Sequence[torch.Tensor]
) -> shm_groups.ShmGroup | None:
    """The shared-memory transport for this call, or ``None`` for gloo (counted either way).

    :raises RuntimeError: when the call would use gloo and ``DS_CPU_SHM_REQUIRE=1``.
    """
    found = shm_groups.lookup(group)
    if isinstance(found, str):
        _gloo(collective, found)
        return None
    reason = found.reason or _tensor_reason(tensors)
    if reason:
        found.drain()  # a gloo call must not overtake the group's queued calls
        _gloo(collective, reason)
        return None
    return found


def _submit(
    transport: shm_groups.ShmGroup,
    collective: str,
    shm_call: Callable[[shm.ShmProtocol], None],
    gloo_call: Callable[[], object],
    async_op: bool,
) -> Work:
    """Queue a call; it runs over shared memory, or over gloo if the group's setup (which the
    group's first call performs) found it cannot."""

    def call() -> None:
        protocol = transport.ready()
        if protocol is None:
            _gloo(collective, transport.reason)
            gloo_call()
        else:
            _count(collective, "shm", "")
            shm_call(protocol)

    work = transport.submit(call, async_op)
    return work if async_op else COMPLETED


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")


# --------------------------------------------------------------------------- hooks


@hookimpl
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    _check_op(op)
    require_contiguous("all_reduce", tensor=tensor)
    transport = route("all_reduce", group, [tensor])
    if transport is None:
        return _gloo_all_reduce(tensor, op, group, async_op)
    flat, shape = tensor.detach().view(-1), tuple(tensor.shape)
    return _submit(
        transport,
        "all_reduce",
        lambda p: p.all_reduce(flat, op, shape),
        lambda: _gloo_all_reduce(tensor, op, group, False),
        async_op,
    )


@hookimpl
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    _check_op(op)
    require_contiguous("reduce_scatter", output=output, input=input)
    transport = route("reduce_scatter", group, [output, input])
    if transport is None:
        return _gloo_reduce_scatter(output, input, op, group, async_op)
    expected = output.numel() * dist.get_world_size(group)
    error = (
        f"reduce_scatter input has {input.numel()} elements, expected {expected}"
        if input.numel() != expected
        else ""
    )
    out, inp, shape = output.detach().view(-1), input.detach().view(-1), tuple(input.shape)
    return _submit(
        transport,
        "reduce_scatter",
        lambda p: p.reduce_scatter(out, inp, op, error, shape),
        lambda: _gloo_reduce_scatter(output, input, op, group, False),
        async_op,
    )


@hookimpl
def ds_comm_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
) -> Work:
    require_contiguous("all_gather", output=output, input=input)
    transport = route("all_gather", group, [output, input])
    if transport is None:
        return _gloo_all_gather(output, input, group, async_op)
    expected = input.numel() * dist.get_world_size(group)
    error = (
        f"all_gather output has {output.numel()} elements, expected {expected}"
        if output.numel() != expected
        else ""
    )
    out, inp, shape = output.detach().view(-1), input.detach().view(-1), tuple(input.shape)
    return _submit(
        transport,
        "all_gather",
        lambda p: p.all_gather(out, inp, error, shape),
        lambda: _gloo_all_gather(output, input, group, False),
        async_op,
    )


@hookimpl
def ds_comm_broadcast(tensor: torch.Tensor, src: int, group: Any, async_op: bool) -> Work:
    require_contiguous("broadcast", tensor=tensor)
    transport = route("broadcast", group, [tensor])
    if transport is None:
        return _gloo_broadcast(tensor, src, group, async_op)
    root = dist.get_group_rank(shm_groups.resolve(group), src)
    flat, shape = tensor.detach().view(-1), tuple(tensor.shape)
    return _submit(
        transport,
        "broadcast",
        lambda p: p.broadcast(flat, root, shape),
        lambda: _gloo_broadcast(tensor, src, group, False),
        async_op,
    )


def _rows(
    what: str, t: torch.Tensor, splits: list[int] | None, world: int
) -> tuple[list[int], str]:
    rows = t.shape[0]
    if splits is None:
        if rows % world:
            return [0] * world, f"all_to_all {what} has {rows} rows, not divisible by {world}"
        return [rows // world] * world, ""
    if len(splits) != world or any(s < 0 for s in splits) or sum(splits) != rows:
        return [0] * world, (
            f"all_to_all {what} split sizes {splits} must be {world} non-negative row counts "
            f"summing to its {rows} rows"
        )
    return list(splits), ""


@hookimpl
def ds_comm_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
    async_op: bool,
) -> Work:
    require_contiguous("all_to_all", output=output, input=input)
    transport = (
        route("all_to_all", group, [output, input]) if input.dim() and output.dim() else None
    )
    if transport is None:
        return _gloo_all_to_all(
            output, input, output_split_sizes, input_split_sizes, group, async_op
        )
    world = dist.get_world_size(group)
    send, send_error = _rows("input", input, input_split_sizes, world)
    recv, recv_error = _rows("output", output, output_split_sizes, world)
    row, out_row = math.prod(input.shape[1:]), math.prod(output.shape[1:])
    error = send_error or recv_error
    if not error and output.dtype != input.dtype:
        error = f"all_to_all output dtype {output.dtype} differs from input dtype {input.dtype}"
    if not error and out_row != row:
        error = f"all_to_all output rows have {out_row} elements, input rows {row}"
    out, inp = output.detach().view(-1), input.detach().view(-1)
    return _submit(
        transport,
        "all_to_all",
        lambda p: p.all_to_all(out, inp, send, recv, row, error),
        lambda: _gloo_all_to_all(
            output, input, output_split_sizes, input_split_sizes, group, False
        ),
        async_op,
    )


@hookimpl
def ds_comm_barrier(group: Any) -> bool:
    transport = route("barrier", group, [])
    if transport is None:
        return _DEFAULT.ds_comm_barrier(group)
    _submit(
        transport,
        "barrier",
        lambda p: p.barrier(),
        lambda: _DEFAULT.ds_comm_barrier(group),
        False,
    )
    return True


# --------------------------------------------------------------------------- gloo paths

_WIDEN = {torch.int16: torch.int32}
_DEFAULT = DefaultCollectives()


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when gloo carries its dtype, else a widened copy."""
    return t.to(_WIDEN[t.dtype]) if t.dtype in _WIDEN else t


class _ThenFinish:
    """Handle of a gloo call that still has a local step (copy a chunk, divide) on wait()."""

    __slots__ = ("_finish", "_work")

    def __init__(self, work: Any, finish: Callable[[], object]) -> None:
        self._work = work
        self._finish: Callable[[], object] | None = finish

    def wait(self) -> bool:
        if self._finish is not None:
            self._work.wait()
            self._finish()
            self._finish = None
        return True


def _then(work: Any, async_op: bool, finish: Callable[[], object]) -> Work:
    handle = _ThenFinish(work, finish)
    if async_op:
        return handle
    handle.wait()
    return COMPLETED


def _gloo_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    if tensor.dtype not in _WIDEN:
        return _DEFAULT.ds_comm_all_reduce(tensor, op, group, async_op)
    wide = _wide(tensor)
    return _then(
        _DEFAULT.ds_comm_all_reduce(wide, op, group, True), async_op, lambda: tensor.copy_(wide)
    )


def _gloo_broadcast(tensor: torch.Tensor, src: int, group: Any, async_op: bool) -> Work:
    if tensor.dtype not in _WIDEN:
        return _DEFAULT.ds_comm_broadcast(tensor, src, group, async_op)
    wide = _wide(tensor)
    return _then(
        _DEFAULT.ds_comm_broadcast(wide, src, group, True), async_op, lambda: tensor.copy_(wide)
    )


def _gloo_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
    async_op: bool,
) -> Work:
    if input.dtype not in _WIDEN:
        return _DEFAULT.ds_comm_all_to_all(
            output, input, output_split_sizes, input_split_sizes, group, async_op
        )
    wide_out = torch.empty_like(output, dtype=_WIDEN[output.dtype])
    work = _DEFAULT.ds_comm_all_to_all(
        wide_out, _wide(input), output_split_sizes, input_split_sizes, group, True
    )
    return _then(work, async_op, lambda: output.copy_(wide_out))


def _gloo_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    """Reduce-scatter as an all-reduce of ``input`` in place, then a copy of this rank's chunk.

    The spec lets ``input`` serve as scratch.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if input.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter input has {input.numel()} elements, expected {output.numel() * world}"
        )
    flat, n = _wide(input).view(-1), output.numel()

    def finish() -> None:
        output.view(-1).copy_(flat[rank * n : (rank + 1) * n])
        if op == "avg":
            output.div_(world)

    torch_op = dist.ReduceOp.SUM if op == "avg" else torch_reduce_op(op)
    return _then(dist.all_reduce(flat, torch_op, group=group, async_op=True), async_op, finish)


def _gloo_all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Work:
    """All-gather as a sum-all-reduce of a buffer zeroed except this rank's slot.

    Adding zeros is exact, except that a gathered ``-0.0`` arrives as ``+0.0``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = input.numel()
    if output.numel() != n * world:
        raise ValueError(f"all_gather output has {output.numel()} elements, expected {n * world}")
    if output.dtype == torch.bool:
        return _DEFAULT.ds_comm_all_gather(output, input, group, async_op)
    wide = output.dtype in _WIDEN
    flat = torch.zeros(n * world, dtype=_WIDEN[output.dtype]) if wide else output.view(-1).zero_()
    flat[rank * n : (rank + 1) * n].copy_(input.reshape(-1))
    work = dist.all_reduce(flat, dist.ReduceOp.SUM, group=group, async_op=True)
    return _then(work, async_op, (lambda: output.view(-1).copy_(flat)) if wide else (lambda: None))
