"""Rank-side jobs of tests/test_cpu_shm_p2p.py (run on the shared rank pools, tests/rankpool.py).

Two ranks on the CPU backend, with slots of 4 KiB (``DS_CPU_SHM_SLOT_BYTES``) so that modest
messages stream through many chunks. Each job returns what it saw; the test asserts.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from ds_backend_cpu import comm as cpu_comm
from ds_backend_cpu import shm, shm_p2p

from ds_core import comm
from ds_core.types import P2POp

P2P_KINDS = ("send", "recv")


def p2p_counts() -> dict[tuple[str, str, str], int]:
    return {k: v for k, v in cpu_comm.transport_counts().items() if k[0] in P2P_KINDS}


def delta(before: dict[Any, int], after: dict[Any, int]) -> dict[Any, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def message(sender: int, receiver: int, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``i``-th test message from ``sender`` to ``receiver``: seeded, distinct per pair."""
    g = torch.Generator().manual_seed(10_000 * sender + 1_000 * receiver + i)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(numel, generator=g) * 100).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, (numel,), generator=g).to(dtype)


# Element counts: empty, one, below a slot, exactly a 4 KiB slot of float32, and several slots.
SIZES = (0, 1, 333, 1024, 3 * 1024 + 7, 10 * 1024 + 3)


def exchanges() -> dict[str, Any]:
    """Sync pairs in every dtype and size, queued async messages, a two-way batch; all with
    ``DS_CPU_SHM_REQUIRE=1`` (a fallback to gloo would raise)."""
    me = dist.get_rank()
    peer = 1 - me
    before = p2p_counts()
    wrong: list[str] = []
    os.environ[cpu_comm.ENV_REQUIRE] = "1"
    try:
        i = 0
        for dtype in shm.DTYPES:
            for numel in SIZES:
                i += 1
                got = torch.empty(numel, dtype=dtype)
                out = message(me, peer, i, numel, dtype)
                if me == 0:
                    comm.send(out, peer)
                    comm.recv(got, peer)
                else:
                    comm.recv(got, peer)
                    comm.send(out, peer)
                if not torch.equal(got, message(peer, me, i, numel, dtype)):
                    wrong.append(f"sync {dtype} x {numel}")
        # Asynchronous: five messages queued back to back arrive in issue order.
        outs = [message(me, peer, 100 + k, 2048 + k, torch.float32) for k in range(5)]
        gots = [torch.empty(2048 + k) for k in range(5)]
        works = [comm.isend(t, peer) for t in outs] + [comm.irecv(t, peer) for t in gots]
        for w in works:
            w.wait()
            w.wait()  # a second wait changes nothing
        for k, got in enumerate(gots):
            if not torch.equal(got, message(peer, me, 100 + k, 2048 + k, torch.float32)):
                wrong.append(f"async message {k}")
        # Both ranks send first, in one batch, a message of 64 chunks: more than the ring of two
        # slots holds, so neither send can finish before the peer's receive runs.
        big = message(me, peer, 200, 64 * 1024, torch.float32)
        got_big = torch.empty(64 * 1024)
        for w in comm.batch_isend_irecv([P2POp("send", big, peer), P2POp("recv", got_big, peer)]):
            w.wait()
            w.wait()
        if not torch.equal(got_big, message(peer, me, 200, 64 * 1024, torch.float32)):
            wrong.append("batch exchange")
    finally:
        os.environ.pop(cpu_comm.ENV_REQUIRE, None)
    end = shm_p2p.pairs(None)[peer]
    return {
        "wrong": wrong,
        "counts": delta(before, p2p_counts()),
        "sync_ops": i,
        "segment": end.segment is not None,
        "reason": end.reason,
    }


def fallback() -> dict[str, Any]:
    """A dtype the transport does not carry goes over gloo, in order with shared-memory
    messages around it; with ``DS_CPU_SHM_REQUIRE=1`` it is refused instead."""
    me = dist.get_rank()
    peer = 1 - me
    before = p2p_counts()
    dtypes = (torch.float32, torch.complex64, torch.float64)
    outs = [message(me, peer, 300 + k, 5000, d) for k, d in enumerate(dtypes)]
    gots = [torch.empty(5000, dtype=d) for d in dtypes]
    works = [comm.isend(t, peer) for t in outs] + [comm.irecv(t, peer) for t in gots]
    for w in works:
        w.wait()
    same = [
        torch.equal(got, message(peer, me, 300 + k, 5000, d))
        for k, (got, d) in enumerate(zip(gots, dtypes, strict=True))
    ]
    os.environ[cpu_comm.ENV_REQUIRE] = "1"
    try:
        comm.send(torch.zeros(3, dtype=torch.complex64), peer)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    finally:
        os.environ.pop(cpu_comm.ENV_REQUIRE, None)
    return {"same": same, "counts": delta(before, p2p_counts()), "refused": refused}


def mismatch() -> dict[str, str]:
    """On a fresh two-rank group, rank 1 posts a receive of the wrong size: both ranks raise
    (rank 0's send is four slots long, so it waits for rank 1 and sees the rejection)."""
    group = dist.new_group([0, 1])
    me = dist.get_rank()
    error = ""
    try:
        if me == 0:
            comm.send(torch.ones(4 * 1024), 1, group)
        else:
            comm.recv(torch.empty(4 * 1024 + 1), 0, group)
    except RuntimeError as exc:
        error = str(exc)
    # The world's channels are unaffected.
    out, got = torch.full((5,), float(me)), torch.empty(5)
    comm.batch_isend_irecv([P2POp("send", out, 1 - me), P2POp("recv", got, 1 - me)])[1].wait()
    return {"error": error, "world_ok": str(torch.equal(got, torch.full((5,), float(1 - me))))}


def ring() -> dict[str, Any]:
    """Every rank sends 64 chunks to the next rank and receives from the previous one in one
    batch, on the world and on a subgroup of ranks {1, 3} whose group ranks differ from their
    global ranks; both over shared memory (``DS_CPU_SHM_REQUIRE=1``)."""
    me, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (me + 1) % world, (me - 1) % world
    numel = 64 * 1024
    before = p2p_counts()
    pair_group = dist.new_group([1, 3])
    os.environ[cpu_comm.ENV_REQUIRE] = "1"
    try:
        got = torch.empty(numel)
        ops = [P2POp("send", message(me, nxt, 400, numel, torch.float32), nxt),
               P2POp("recv", got, prv)]  # fmt: skip
        for w in comm.batch_isend_irecv(ops):
            w.wait()
        ok = [torch.equal(got, message(prv, me, 400, numel, torch.float32))]
        if me in (1, 3):
            peer = 4 - me
            got = torch.empty(numel)
            ops = [P2POp("send", message(me, peer, 401, numel, torch.float32), peer, pair_group),
                   P2POp("recv", got, peer, pair_group)]  # fmt: skip
            for w in comm.batch_isend_irecv(ops):
                w.wait()
            ok.append(torch.equal(got, message(peer, me, 401, numel, torch.float32)))
    finally:
        os.environ.pop(cpu_comm.ENV_REQUIRE, None)
    return {"ok": ok, "counts": delta(before, p2p_counts())}
