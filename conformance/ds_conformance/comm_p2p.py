"""Point-to-point cases (capability ``p2p``) of :mod:`ds_conformance.comm_cases`: how a rank
runs one, with the helpers of that module (kept apart for size)."""

from __future__ import annotations

import time

import torch

from ds_conformance.comm_cases import (
    LARGE_NUMEL,
    LATE_S,
    MARKER_TIMEOUT_S,
    Case,
    Context,
    Placement,
    _check,
    _fail,
    _members,
    _wait_for,
)
from ds_conformance.values import rank_values


def _message(
    sender: int, receiver: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """What global rank ``sender`` sends to ``receiver``: distinct for every ordered pair."""
    numel = 1
    for d in shape:
        numel *= d
    return rank_values(sender, numel, dtype, 4, salt=receiver + 1).reshape(shape)


#: What the second message of a pair adds to the first (exact in every float dtype used).
SECOND = 0.5


def run_p2p(ctx: Context, case: Case) -> None:
    """One point-to-point case (see :func:`_p2p_cases`); every handle is waited twice."""
    from ds_core.types import P2POp

    acc, dtype = ctx.acc, getattr(torch, case.dtype)
    members, group = _members(ctx, case)
    world, me = len(members), members.index(ctx.rank)
    shape = (LARGE_NUMEL,) if case.variant == "large" else (3, 5)
    place = Placement(case, acc.device())
    if case.variant == "late-async":
        _run_p2p_late(ctx, case, shape, dtype, place)
        return
    if case.variant == "peers":
        _run_p2p_peers(ctx, case, place.empty(shape, dtype))
        return
    if case.variant == "pair":
        # Even group ranks send first and then receive the reply; odd ones the other way round.
        peer = members[me ^ 1] if (me ^ 1) < world else members[me - 1]
        # Two messages each way, matched in issue order (the second differs from the first).
        got, got2 = place.empty(shape, dtype), place.empty(shape, dtype)
        dest = peer
        outgoing = place.put(_message(ctx.rank, peer, shape, dtype))
        outgoing2 = place.put(_message(ctx.rank, peer, shape, dtype) + SECOND)
        steps = [("send", outgoing), ("send", outgoing2), ("recv", got), ("recv", got2)]
        works = []
        for kind, t in steps if me % 2 == 0 else steps[2:] + steps[:2]:
            if kind == "send":
                works.append(acc.send(t, peer, group, 0, case.async_op))
            else:
                works.append(acc.recv(t, peer, group, 0, case.async_op))
        expected = _message(peer, ctx.rank, shape, dtype)
        second = (got2, expected + SECOND)
    else:  # a ring: send to the next group rank, receive from the previous, in one batch
        second = None
        nxt, prv = members[(me + 1) % world], members[(me - 1) % world]
        got = place.empty(shape, dtype)
        dest = nxt
        outgoing = place.put(_message(ctx.rank, nxt, shape, dtype))
        ops = [P2POp("send", outgoing, nxt, group), P2POp("recv", got, prv, group)]
        works = acc.batch_isend_irecv(ops)
        if len(works) != len(ops):
            _fail(ctx, case, "batch_isend_irecv handles", len(works), len(ops))
        expected = _message(prv, ctx.rank, shape, dtype)
    for work in works:
        work.wait()
        work.wait()  # a second wait is allowed and changes nothing
    acc.synchronize()
    _check(ctx, case, got, expected)
    if second is not None:
        _check(ctx, case, *second)
    place.check_guards(ctx, case)
    if not torch.equal(outgoing.cpu(), _message(ctx.rank, dest, shape, dtype)):  # not modified
        _fail(ctx, case, "the sent tensor after the send", "changed", "unmodified")


def _run_p2p_peers(ctx: Context, case: Case, buffer: torch.Tensor) -> None:
    """The peer axis: this rank and a rank just outside the world at each end are refused by
    the facade with ``ValueError`` naming the argument, before anything is sent (no peer takes
    part, so a call that communicated would hang or fail differently)."""
    for bad in (ctx.rank, -1, case.world):
        for name, call in (("dst", ctx.acc.send), ("src", ctx.acc.recv)):
            try:
                call(buffer, bad, None, 0, case.async_op)
            except ValueError as e:
                if name not in str(e):
                    _fail(ctx, case, f"the ValueError of {call.__name__}({name}={bad})", str(e),
                          f"a message naming {name!r}")  # fmt: skip
                continue
            except Exception as e:
                _fail(ctx, case, f"{call.__name__}({name}={bad})", repr(e), "ValueError")
            _fail(ctx, case, f"{call.__name__}({name}={bad})", "no error", "ValueError")
    # A receive buffer whose elements share memory, to a real peer: refused before it is posted.
    shared = torch.zeros(1, dtype=buffer.dtype, device=buffer.device).expand(buffer.numel())
    try:
        ctx.acc.recv(shared, (ctx.rank + 1) % case.world, None, 0, case.async_op)
    except ValueError as e:
        if "tensor" not in str(e):
            _fail(ctx, case, "the ValueError of recv(expand()ed tensor)", str(e), "naming 'tensor'")
        return
    _fail(ctx, case, "recv(an expand()ed tensor)", "no error", "ValueError")


def _run_p2p_late(
    ctx: Context, case: Case, shape: tuple[int, ...], dtype: torch.dtype, place: Placement
) -> None:
    """Rank 0 posts an asynchronous receive before rank 1 has sent: the call returns at once
    (rank 1 sends only after seeing that), and ``wait()`` then delivers the message."""
    returned = ctx.scratch / f"{case.key}.early-returned"
    if ctx.rank == 0:
        got = place.empty(shape, dtype)
        work = ctx.acc.recv(got, 1, None, 0, True)
        returned.touch()
        work.wait()
        work.wait()
        ctx.acc.synchronize()
        _check(ctx, case, got, _message(1, 0, shape, dtype))
        place.check_guards(ctx, case)
        return
    if not _wait_for(returned, MARKER_TIMEOUT_S):
        raise AssertionError(
            f"rank {ctx.rank}: rank 0's recv(async_op=True) did not return within "
            f"{MARKER_TIMEOUT_S:.0f} s while its sender had not sent, but should return at "
            f"once [{case.collective}({case.id})]"
        )
    time.sleep(LATE_S)  # rank 0's wait() now really has to wait for this send
    ctx.acc.send(place.put(_message(1, 0, shape, dtype)), 0, None, 0, False)
    ctx.acc.synchronize()  # a device runs queued work eventually; a lazy simulator only here
