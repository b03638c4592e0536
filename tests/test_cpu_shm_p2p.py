"""The CPU backend's point-to-point over shared memory (``ds_backend_cpu.shm_p2p``).

Exactness against the sent tensors (bit for bit, every dtype the transport carries), that the
shared-memory path was taken (the backend's transport counters, and ``DS_CPU_SHM_REQUIRE=1``
that makes any fallback an error), the gloo fallback for other dtypes, a mismatch seen by both
ranks, a ring of four ranks and a subgroup exchanging messages larger than the ring of slots in
one batch, and a peer that dies after the channel was set up. Ranks are real processes: the rank
pool (tests/rankpool.py), and for the dying peer two processes of its own, forked from a server
that imported torch and ds_core (tests/forkrank.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import _p2p_worker as worker
from tests.rankpool import RankPools, run_script_ranks

JOB = "tests._p2p_worker"
ENV = {"DS_ACCELERATOR": "cpu", "DS_CPU_SHM_SLOT_BYTES": "4096"}


def _run(rank_pools: RankPools, job: str) -> list[Any]:
    return rank_pools.get(2, ENV).run(f"{JOB}:{job}")


@pytest.mark.slow
def test_messages_arrive_exactly_over_shared_memory(rank_pools: RankPools) -> None:
    results = _run(rank_pools, "exchanges")
    for rank, r in enumerate(results):
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["segment"] and r["reason"] == "", (rank, r)
        # Every op of the job went over shared memory: sync pairs, 5 + 5 async, a 2-op batch.
        sends = recvs = r["sync_ops"] + 5 + 1
        assert r["counts"] == {("send", "shm", ""): sends, ("recv", "shm", ""): recvs}, r


@pytest.mark.slow
def test_a_dtype_the_transport_refuses_goes_over_gloo_in_order(rank_pools: RankPools) -> None:
    for r in _run(rank_pools, "fallback"):
        assert r["same"] == [True, True, True], r
        reason = "dtype torch.complex64"
        assert r["counts"] == {
            ("send", "shm", ""): 2,
            ("recv", "shm", ""): 2,
            ("send", "gloo", reason): 1,
            ("recv", "gloo", reason): 1,
        }, r
        assert "DS_CPU_SHM_REQUIRE=1 forbids it" in r["refused"], r


@pytest.mark.slow
def test_a_size_mismatch_fails_on_both_ranks_naming_it(rank_pools: RankPools) -> None:
    sender, receiver = _run(rank_pools, "mismatch")
    assert "recv from rank 0" in receiver["error"], receiver
    assert "numel=4096" in receiver["error"] and "numel=4097" in receiver["error"], receiver
    assert "send to rank 1" in sender["error"] and "rejected" in sender["error"], sender
    assert sender["world_ok"] == receiver["world_ok"] == "True"


DYING_PEER = """
import os, sys
import torch
import ds_core
from ds_core import comm
from ds_backend_cpu import comm as cpu_comm

ds_core.init_distributed(timeout=300)
os.environ[cpu_comm.ENV_REQUIRE] = "1"  # the channel is shared memory, never gloo
peer = 1 - comm.get_rank()
buf = torch.zeros(1 << 12)
if comm.get_rank() == 0:
    comm.send(buf, peer)
    try:
        comm.recv(buf, peer) if sys.argv[1] == "sync" else comm.irecv(buf, peer).wait()
    except RuntimeError as exc:
        print("RAISED", str(exc).splitlines()[0][:400], flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(1)
comm.recv(buf, peer)
os._exit(0)  # dies without sending the reply
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_peer_dying_after_setup_is_named_by_the_transport(mode: str) -> None:
    # a hang guard, not a speed check
    out = run_script_ranks(DYING_PEER, [mode], 2, 600, DS_ACCELERATOR="cpu")
    lines = [line for line in out.splitlines() if line.startswith(("RAISED", "NO ERROR"))]
    assert lines and lines[-1].startswith("RAISED"), out[-3000:]
    assert "recv from rank 1" in lines[-1], lines[-1]
    # The shared-memory transport noticed (its liveness check), not gloo nor a timeout.
    assert "shared-memory recv from rank 1: rank 1 (pid" in lines[-1], lines[-1]
    assert "exited" in lines[-1] and "timeout" not in lines[-1].lower(), lines[-1]


def test_the_worker_messages_differ_per_pair() -> None:
    # The exactness checks above mean something only if each direction's data differs.
    import torch

    a, b = worker.message(0, 1, 1, 64, torch.float32), worker.message(1, 0, 1, 64, torch.float32)
    assert not torch.equal(a, b)


@pytest.mark.slow
def test_a_ring_of_four_and_a_subgroup_exchange_large_messages_in_one_batch(
    rank_pools: RankPools,
) -> None:
    results = rank_pools.get(4, ENV).run(f"{JOB}:ring")
    for rank, r in enumerate(results):
        pairs = 2 if rank in (1, 3) else 1
        assert r["ok"] == [True] * pairs, (rank, r)
        assert r["counts"] == {("send", "shm", ""): pairs, ("recv", "shm", ""): pairs}, r
