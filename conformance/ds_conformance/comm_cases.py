"""Collective cases: shared by the test module (ids) and the rank workers (execution).

Every rank builds every rank's input from ``(rank, case)`` alone, so it checks its result
against a local computation without trusting any other collective. The data comes from
:mod:`ds_conformance.values`: per-rank distinct, non-symmetric, exact in the dtype and not in
a narrower one, with sizes that are not powers of two (13 elements, 5 and 7 per rank, uneven
all-to-all splits). Every reduce op is tested on every dtype it applies to, in the world group
and (on 4 ranks) in two interleaved subgroups, where group ranks differ from global ranks.

Semantics cases (``late-*`` variants, 2 ranks) make one rank join late and check what the
contract says about blocking: a barrier and a synchronous collective do not return before the
late peer joins; an asynchronous call returns before its peers join, and ``wait()`` makes the
result visible. A marker file written by the late rank just before it joins makes this a
causal check, not a timing threshold: a correct backend passes however slow the host is.

Large cases (``large`` variant, float32) move :data:`LARGE_NUMEL` elements per rank, past one
staging buffer of typical backends (the CPU backend's shared-memory slot is 4 MiB, a vendor
library's chunk a few MiB). The count is odd (a partial last piece) and the data's period (35
elements) divides no power-of-two piece, so a piece written at another's offset differs.

Layout cases (variants in :data:`LAYOUTS`, float32, every op of every collective, sync and
async, 2 and 4 ranks) hand the collective non-contiguous views (the rule under "Layout" in
``ds_core.hookspecs.comm``): ``strided`` puts every tensor in one column of a two-column
buffer (the column ``x[:, 1]``), ``transposed`` makes 2-D tensors the transpose of a padded
buffer (1-D ones are strided). Every element outside a view holds :data:`GUARD`, checked
after the collective, so reading or writing past the view fails even where the view is right.

Two-group cases (``two-groups`` variant, 4 ranks, every collective): a collective on this
rank's subgroup and one on the world are both in flight before either is waited for, and
they are waited in the reverse order of issue.

Refused cases (``refused`` variant, 2 ranks, every collective): each call the contract
refuses with ``ValueError`` (an ``expand()``ed output or in-place buffer, an unknown op, sizes
that do not fit), on every rank, then an all-reduce that must still pair up.

Size cases (:data:`SIZES`: zero-size and one-element tensors, every collective but all-to-all,
whose splits are fixed). Every asynchronous handle is waited twice: a second wait is allowed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_conformance.axes import queue_copy
from ds_conformance.values import REDUCE_OPS, op_applies, product_values, rank_values, reduce

WORLD_SIZES: tuple[int, ...] = (2, 4)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
#: Interleaved subgroups of a 4-rank world (global rank != group rank for 3 of 4 ranks).
SUBGROUPS: tuple[tuple[int, ...], ...] = ((0, 2), (1, 3))
#: (collective, op) of the synchronous late-peer cases besides the barrier's.
LATE_SYNC: tuple[tuple[str, str], ...] = (("all_reduce", "sum"), ("broadcast", ""))
#: Seconds a late rank waits before joining; only how convincing a failure is depends on it.
LATE_S = 0.3
#: Seconds a late rank waits for the early rank's "my async call returned" marker.
MARKER_TIMEOUT_S = 30.0
#: Elements per rank of a ``large`` case: 16 MiB of float32 (4 CPU shared-memory slots and a
#: partial fifth at the default slot size), odd so no piece size divides it.
LARGE_NUMEL = 2**22 + 13
#: Results longer than this are reported by their first differing positions, not in full.
REPORT_NUMEL = 64
#: Elements per rank of the zero-size and one-element cases (sync and async, 2 and 4 ranks).
SIZES: dict[str, int] = {"empty": 0, "one": 1}
#: Variants whose tensors are non-contiguous views (see :class:`Placement`).
LAYOUTS: tuple[str, ...] = ("strided", "transposed")
#: What a layout case's buffers hold outside their views (no rank's data comes near it).
GUARD = -1000.0


@dataclass(frozen=True)
class Case:
    collective: str
    world: int
    dtype: str  # torch dtype name without "torch."
    op: str = ""
    async_op: bool = False
    # "", "group", "two-groups", "equal-splits", "large", "late-sync", "late-async", "stream-*",
    # or a LAYOUT
    variant: str = ""

    @property
    def id(self) -> str:
        parts = [
            self.op,
            self.dtype,
            "async" if self.async_op else "",
            self.variant,
            f"w{self.world}",
        ]
        return "-".join(p for p in parts if p)

    @property
    def key(self) -> str:
        return f"{self.collective}[{self.id}]"

    @property
    def capability(self) -> str:
        """The capability a case needs ("" for every backend)."""
        if self.collective == "p2p":
            return "p2p"
        return "async_streams" if self.variant.startswith("stream-") else ""


def _reduces(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not str(dtype).startswith("torch.float8")


def cases(dtypes: Iterable[torch.dtype]) -> list[Case]:
    """Every case for the claimed ``dtypes`` (float8 is not exchanged: no reduction defines it)."""
    names = sorted(
        str(d).removeprefix("torch.") for d in dtypes if not str(d).startswith("torch.float8")
    )
    out: list[Case] = []
    for world in WORLD_SIZES:
        for name in names:
            dtype = getattr(torch, name)
            out += [
                Case("all_reduce", world, name, op) for op in REDUCE_OPS if op_applies(op, dtype)
            ]
            out.append(Case("all_gather", world, name))
            if _reduces(dtype):
                out += [
                    Case("reduce_scatter", world, name, op)
                    for op in REDUCE_OPS
                    if op_applies(op, dtype)
                ]
            out.append(Case("broadcast", world, name))
            out.append(Case("all_to_all", world, name))
        out.append(Case("all_to_all", world, "float32", variant="equal-splits"))
        for collective in COLLECTIVES[:-1]:
            op = "sum" if collective in ("all_reduce", "reduce_scatter") else ""
            out.append(Case(collective, world, "float32", op, async_op=True))
        out.append(Case("barrier", world, ""))
        for layout in LAYOUTS:
            for collective in COLLECTIVES[:-1]:
                ops = REDUCE_OPS if collective in ("all_reduce", "reduce_scatter") else ("",)
                for op in ops:
                    for async_op in (False, True):
                        out.append(Case(collective, world, "float32", op, async_op, layout))
    for collective in COLLECTIVES[:-1]:
        op = "avg" if collective in ("all_reduce", "reduce_scatter") else ""
        out.append(Case(collective, 4, "float32", op, variant="group"))
        out.append(Case(collective, 4, "float32", op, async_op=True, variant="two-groups"))
        out.append(Case(collective, 2, "float32", op, variant="refused"))
    for op in ("sum", "avg"):
        out.append(Case("all_reduce", 2, "float32", op, variant="large"))
    out.append(Case("all_reduce", 4, "float32", "sum", variant="large"))
    out.append(Case("reduce_scatter", 2, "float32", "sum", variant="large"))
    for collective in ("all_gather", "broadcast"):
        out.append(Case(collective, 2, "float32", variant="large"))
    out.append(Case("barrier", 2, "", variant="late-sync"))
    out += [Case(c, 2, "float32", o, variant="late-sync") for c, o in LATE_SYNC]
    for collective in COLLECTIVES[:-1]:
        op = "sum" if collective in ("all_reduce", "reduce_scatter") else ""
        for variant in ("late-async", "stream-after-current", "stream-wait-orders"):
            out.append(Case(collective, 2, "float32", op, async_op=True, variant=variant))
        for variant in SIZES if collective != "all_to_all" else ():  # its splits are fixed
            out += [Case(collective, w, "float32", op, a, variant) for w in WORLD_SIZES
                    for a in (False, True)]  # fmt: skip
    return out + _p2p_cases(names)


def _p2p_cases(dtypes: list[str]) -> list[Case]:
    """Point-to-point (capability ``p2p``): a ring exchange in one batch for every dtype, a
    send/recv pair (sync and async), non-contiguous views, a subgroup whose ranks are not its
    group ranks, a message past staging sizes, and a receive posted before its sender joined."""
    out: list[Case] = []
    for world in WORLD_SIZES:
        out += [Case("p2p", world, name, variant="ring") for name in dtypes]
        for async_op in (False, True):
            out.append(Case("p2p", world, "float32", async_op=async_op, variant="pair"))
        out += [Case("p2p", world, "float32", async_op=True, variant=v) for v in LAYOUTS]
    out.append(Case("p2p", 4, "float32", async_op=True, variant="group"))
    out += [
        Case("p2p", w, "float32", async_op=a, variant="peers")
        for w in WORLD_SIZES
        for a in (False, True)
    ]
    out.append(Case("p2p", 2, "float32", async_op=True, variant="large"))
    out.append(Case("p2p", 2, "float32", async_op=True, variant="late-async"))
    return out


# --------------------------------------------------------------------------- one case


@dataclass
class Context:
    """What a rank needs besides the case: its accelerator, rank, groups and a shared folder."""

    acc: Any
    rank: int
    scratch: Path  # a folder every rank of the group sees (marker files)
    groups: dict[tuple[int, ...], Any]  # subgroup ranks -> process group (world 4 only)


def _inputs(
    case: Case, rank: int, numel: int, dtype: torch.dtype, world: int, salt: int = 0
) -> torch.Tensor:
    if case.op == "product":
        return product_values(rank, numel, dtype)
    return rank_values(rank, numel, dtype, world, salt)


def _fail(ctx: Context, case: Case, what: str, got: Any, expected: Any) -> None:
    raise AssertionError(
        f"rank {ctx.rank} {what}={got}, but should be {expected} [{case.collective}({case.id})]"
    )


def _numel(case: Case, small: int) -> int:
    """Elements per rank: ``small`` (a case's usual odd count), or the variant's size."""
    return {"large": LARGE_NUMEL, **SIZES}.get(case.variant, small)


class Placement:
    """Puts a case's tensors on the device: plain tensors, or for a layout case (a variant in
    :data:`LAYOUTS`) non-contiguous views into buffers that hold :data:`GUARD` elsewhere."""

    def __init__(self, case: Case, device: Any) -> None:
        self.device = device
        self.layout = case.variant if case.variant in LAYOUTS else ""
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, view of it)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` on the device, in the case's layout (an input, or a buffer reduced
        or broadcast in place)."""
        if not self.layout:
            return t.to(self.device, copy=True)
        view = self._view(tuple(t.shape), t.dtype)
        view.copy_(t.to(self.device))
        return view

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An output of ``shape`` on the device, in the case's layout, contents unspecified."""
        if not self.layout:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._view(shape, dtype)

    def _view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.layout == "transposed" and len(shape) == 2:
            rows, cols = shape
            buffer = torch.full((cols, rows + 1), GUARD, dtype=dtype, device=self.device)
            view = buffer[:, :rows].t()  # strides (1, rows + 1): a padded transpose
        else:
            buffer = torch.full((*shape, 2), GUARD, dtype=dtype, device=self.device)
            view = buffer[..., 1]  # every element 2 apart, with a guard between
        if view.numel() > 1 and view.is_contiguous():
            raise AssertionError(f"a {self.layout} view of shape {shape} came out contiguous")
        self._views.append((buffer, view))
        return view

    def check_guards(self, ctx: Context, case: Case) -> None:
        """Fail when anything outside the views was written.

        :raises AssertionError: naming the first view whose buffer changed outside it.
        """
        for number, (buffer, view) in enumerate(self._views):
            outside = torch.ones(buffer.shape, dtype=torch.bool, device=buffer.device)
            outside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
            spilled = buffer[outside].cpu()
            wrong = (spilled != GUARD).nonzero().flatten()
            if wrong.numel():
                _fail(
                    ctx,
                    case,
                    f"buffer {number} outside its {self.layout} view (shape "
                    f"{tuple(view.shape)}, strides {view.stride()}) at {wrong.numel()} "
                    "elements, first values",
                    spilled[wrong[:8]].tolist(),
                    f"untouched ({GUARD})",
                )


def _check(ctx: Context, case: Case, got: torch.Tensor, expected: torch.Tensor) -> None:
    result = got.cpu()
    if result.dtype == expected.dtype and torch.equal(result, expected):
        return
    if result.dtype != expected.dtype or result.numel() <= REPORT_NUMEL:
        _fail(ctx, case, "result", result.flatten().tolist(), expected.flatten().tolist())
    # A full listing of millions of elements would bury the message; name where it differs.
    flat, want = result.flatten(), expected.flatten()
    if flat.numel() != want.numel():
        _fail(ctx, case, "result numel", flat.numel(), want.numel())
    wrong = (flat != want).nonzero().flatten()
    first = wrong[:8].tolist()
    _fail(
        ctx,
        case,
        f"result ({wrong.numel()} of {want.numel()} elements differ, first at {first})",
        flat[wrong[:8]].tolist(),
        want[wrong[:8]].tolist(),
    )


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_case(ctx: Context, case: Case) -> None:
    """Run ``case`` on this rank through the accelerator's comm hooks and check the result.

    :raises AssertionError: with the suite's message shape when the result is wrong.
    """
    if case.collective == "p2p":
        from ds_conformance.comm_p2p import run_p2p  # it builds on this module's helpers

        run_p2p(ctx, case)
    elif case.variant.startswith("late-"):
        _run_late(ctx, case)
    elif case.variant.startswith("stream-"):
        _run_stream(ctx, case)
    elif case.variant == "two-groups":
        _run_two_groups(ctx, case)
    elif case.variant == "refused":
        from ds_conformance.comm_refusals import run_refused  # it builds on this module

        run_refused(ctx, case)
    elif case.collective == "barrier":
        for _ in range(3):
            if ctx.acc.barrier() is not True:
                _fail(ctx, case, "barrier()", "not True", "True")
    else:
        _run_plain(ctx, case)


def _members(ctx: Context, case: Case) -> tuple[tuple[int, ...], Any]:
    """(global ranks of this rank's group in group-rank order, the process group or None)."""
    if case.variant == "group":
        members = next(g for g in SUBGROUPS if ctx.rank in g)
        return members, ctx.groups[members]
    return tuple(range(case.world)), None


def _run_plain(ctx: Context, case: Case, late: Callable[[], None] | None = None) -> None:
    acc, device = ctx.acc, ctx.acc.device()
    dtype = getattr(torch, case.dtype)
    members, group = _members(ctx, case)
    world, me = len(members), members.index(ctx.rank)  # group size, group rank
    if late is not None:
        late()
    run = _COLLECTIVES[case.collective]
    place = Placement(case, device)
    got, expected, work = run(acc, case, place, dtype, members, me, world, group)
    if not case.async_op and not place.layout and "async_streams" not in acc.capabilities:
        _check(ctx, case, got, expected)  # in the buffer when the call returns, before any sync
    for _ in range(2 if case.async_op else 0):  # a second wait is allowed and changes nothing
        work.wait()
    acc.synchronize()
    _check(ctx, case, got, expected)
    place.check_guards(ctx, case)


def _run_two_groups(ctx: Context, case: Case) -> None:
    """Two collectives in flight at once on different groups: this rank's subgroup (of
    :data:`SUBGROUPS`) and the world, both issued asynchronously before either is waited for,
    then waited in the reverse order. Every rank issues them in the same order; the groups'
    results differ, so one group's data landing in the other's buffers fails."""
    acc, dtype = ctx.acc, getattr(torch, case.dtype)
    run = _COLLECTIVES[case.collective]
    place = Placement(case, acc.device())
    sub = next(g for g in SUBGROUPS if ctx.rank in g)
    world = tuple(range(case.world))
    first = run(acc, case, place, dtype, sub, sub.index(ctx.rank), len(sub), ctx.groups[sub])
    second = run(acc, case, place, dtype, world, ctx.rank, case.world, None)
    for _ in range(2):  # a second wait is allowed and changes nothing
        second[2].wait()
        first[2].wait()
    acc.synchronize()
    _check(ctx, case, first[0], first[1])
    _check(ctx, case, second[0], second[1])


Run = Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]


def _all_reduce(
    acc: Any, case: Case, place: Placement, dtype: torch.dtype, members: tuple[int, ...],
    me: int, world: int, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
    data = [_inputs(case, r, _numel(case, 13), dtype, world) for r in members]
    expected = reduce(data, case.op)
    tensor = place.put(data[me])  # reduced in place
    work = acc.all_reduce(tensor, case.op, group, case.async_op)
    return tensor, expected, work


def _all_gather(
    acc: Any, case: Case, place: Placement, dtype: torch.dtype, members: tuple[int, ...],
    me: int, world: int, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
    n = _numel(case, 7)
    data = [rank_values(r, n, dtype, world) for r in members]
    got = place.empty((n * world,), dtype)
    work = acc.all_gather(got, place.put(data[me]), group, case.async_op)
    return got, torch.cat(data), work


def _reduce_scatter(
    acc: Any, case: Case, place: Placement, dtype: torch.dtype, members: tuple[int, ...],
    me: int, world: int, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
    n = _numel(case, 5)
    full = [_inputs(case, r, n * world, dtype, world) for r in members]
    expected = reduce(full, case.op)[me * n : (me + 1) * n]
    got = place.empty((n,), dtype)
    work = acc.reduce_scatter(got, place.put(full[me]), case.op, group, case.async_op)
    return got, expected, work


def _broadcast(
    acc: Any, case: Case, place: Placement, dtype: torch.dtype, members: tuple[int, ...],
    me: int, world: int, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
    src = members[-1]  # a global rank that is not the group's rank 0
    n = _numel(case, 11)
    expected = rank_values(src, n, dtype, world)
    own = rank_values(members[me], n, dtype, world, salt=0 if me == world - 1 else 5)
    got = place.put(own)
    work = acc.broadcast(got, src, group, case.async_op)
    return got, expected, work


def _split(rank: int, peer: int) -> int:
    """Rows ``rank`` sends to ``peer`` in all-to-all: uneven, 1..3."""
    return (rank + 2 * peer) % 3 + 1


def _all_to_all(
    acc: Any, case: Case, place: Placement, dtype: torch.dtype, members: tuple[int, ...],
    me: int, world: int, group: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
    equal = case.variant == "equal-splits"

    def split(sender: int, receiver: int) -> int:
        return 2 if equal else _split(sender, receiver)

    def rows(sender: int) -> torch.Tensor:
        n = sum(split(sender, q) for q in range(world))
        return rank_values(members[sender], 3 * n, dtype, world).reshape(n, 3)

    pieces = []
    for peer in range(world):
        start = sum(split(peer, q) for q in range(me))
        pieces.append(rows(peer)[start : start + split(peer, me)])
    sends = None if equal else [split(me, peer) for peer in range(world)]
    recvs = None if equal else [split(peer, me) for peer in range(world)]
    got = place.empty((sum(split(p, me) for p in range(world)), 3), dtype)
    work = acc.all_to_all(got, place.put(rows(me)), recvs, sends, group, case.async_op)
    return got, torch.cat(pieces), work


_COLLECTIVES: dict[str, Run] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
}


# --------------------------------------------------------------------------- late peers


def _run_late(ctx: Context, case: Case) -> None:
    """One rank joins late; check blocking (sync) or non-blocking + wait (async)."""
    late_rank = case.world - 1
    joined = ctx.scratch / f"{case.key}.late-joins"
    returned = ctx.scratch / f"{case.key}.early-returned"
    has_streams = "async_streams" in ctx.acc.capabilities
    if case.async_op:  # rank 0 calls first; the others join only after its call returned
        if ctx.rank == 0:
            acc, device, dtype = ctx.acc, ctx.acc.device(), getattr(torch, case.dtype)
            members = tuple(range(case.world))
            run = _COLLECTIVES[case.collective]
            place = Placement(case, device)
            got, expected, work = run(acc, case, place, dtype, members, 0, case.world, None)
            returned.touch()
            work.wait()
            work.wait()  # a second wait is allowed and changes nothing
            acc.synchronize()
            _check(ctx, case, got, expected)
            return

        def after_rank0_returned() -> None:
            if not _wait_for(returned, MARKER_TIMEOUT_S):
                raise AssertionError(
                    f"rank {ctx.rank}: rank 0's {case.collective}(async_op=True) did not return "
                    f"within {MARKER_TIMEOUT_S:.0f} s while this peer had not joined, but "
                    f"should return before its peers join [{case.collective}({case.id})]"
                )
            time.sleep(LATE_S)  # rank 0's wait() now really has to wait for us

        _run_plain(ctx, case, late=after_rank0_returned)
        return

    def join_late() -> None:
        if ctx.rank == late_rank:
            time.sleep(LATE_S)
            joined.touch()

    if case.collective == "barrier":
        join_late()
        ctx.acc.barrier()
    else:
        _run_plain(ctx, case, late=join_late)
    if ctx.rank != late_rank and not has_streams and not joined.exists():
        _fail(ctx, case, "returned before the late rank joined", True, "False (it blocks)")


# --------------------------------------------------------------------------- streams


def _run_stream(ctx: Context, case: Case) -> None:
    """Stream ordering of an asynchronous collective (backends declaring ``async_streams``).

    ``stream-after-current``: the inputs are made by copies queued on a side stream (which a
    device queues, where it may run kernels at once: :mod:`ds_conformance.axes`), and the
    collective is called with that stream current and no other sync; it must read the copies.
    ``stream-wait-orders``: after ``wait()`` under another stream, work queued on that stream
    (and nothing else) must see the result.
    """
    acc, args = ctx.acc, (torch.float32, tuple(range(case.world)), ctx.rank, case.world, None)
    side, run = acc.Stream(), _COLLECTIVES[case.collective]
    side.wait_stream(acc.current_stream())
    if case.variant == "stream-after-current":
        place: Placement = _QueuedPlacement(case, acc, side)
        with acc.stream(side):
            got, expected, work = run(acc, case, place, *args)
            work.wait()
    else:
        got, expected, work = run(acc, case, Placement(case, acc.device()), *args)
        with acc.stream(side):
            work.wait()  # orders the side stream after the collective
            got = got * 1  # queued on the side stream, after the wait
    acc.current_stream().wait_stream(side)
    acc.synchronize()
    _check(ctx, case, got, expected)


class _QueuedPlacement(Placement):
    """Inputs put on the device by a copy queued on ``stream`` (see :func:`_run_stream`)."""

    def __init__(self, case: Case, acc: Any, stream: Any) -> None:
        super().__init__(case, acc.device())
        self.acc, self.stream, self.sources = acc, stream, list[torch.Tensor]()

    def put(self, t: torch.Tensor) -> torch.Tensor:
        self.sources.append(t.to(self.device, copy=True))  # on the stream, before the copy
        return queue_copy(self.acc, self.stream, self.sources[-1])
