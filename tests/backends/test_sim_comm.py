"""simccl, the sim backend's collectives: every collective across real processes in both async
modes, bytes through the CPU backend's shared memory, the link model's time and wire bytes.
The device itself: test_sim.py. The ranks are the session's rank pools (tests/rankpool.py),
shared with the other suites that run sim ranks of the same settings; their jobs:
tests/backends/_sim_comm_worker.py."""

from __future__ import annotations

import pytest

pytest.importorskip("ds_backend_sim")

from tests.backends.helpers import SIM_MODES as MODES
from tests.rankpool import RankPools
from tests.zero._common import backend_env

JOBS = "tests.backends._sim_comm_worker"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_simccl_collectives_across_processes(world: int, mode: str, rank_pools: RankPools) -> None:
    env = backend_env(f"sim-{mode}", world)
    results = rank_pools.get(world, env).run(f"{JOBS}:collectives_job")
    total = float(sum(range(1, world + 1)))
    for rank, got in enumerate(results):
        assert got["all_reduce"] == [total] * 4
        assert got["max"] == [float(world)] * 2
        assert got["all_gather"] == [float(r) for r in range(world) for _ in range(2)]
        assert got["reduce_scatter"] == [float(rank * world)]
        assert got["broadcast"] == [float(world - 1)] * 2
        assert got["all_to_all"] == [float(rank + 10 * r) for r in range(world)]
        assert got["async"] == [float(sum(range(world)))] * 3
        if rank % 2 == 0:
            assert got["subgroup"] == [float(len(range(0, world, 2)))] * 2
        assert got["objects"] == list(range(world))
        # seven collectives on sim tensors, the sub-group's on even ranks; objects and the
        # barrier travel on the host
        assert got["counters"]["collectives"] == 7 + (rank % 2 == 0)


@pytest.mark.slow
def test_simccl_moves_bytes_through_the_cpu_backends_shared_memory(rank_pools: RankPools) -> None:
    # The same calls with the CPU backend's transport on and off (DS_CPU_SHM=0): the transport
    # that ran is reported, and both give the same bits (both reduce in rank order).
    runs = {}
    for shm, mode in (("1", "threads"), ("0", "lazy")):
        env = {**backend_env(f"sim-{mode}", 2), "DS_CPU_SHM": shm}
        env["DS_CPU_SHM_SLOT_BYTES"] = "4096"
        runs[shm] = rank_pools.get(2, env).run(f"{JOBS}:transports_job")
    calls = 2 * 2 * 6 + 6  # (dtypes x sizes x collectives) + the value checks
    for rank in (0, 1):
        on, off = runs["1"][rank], runs["0"][rank]
        for got in (on, off):
            assert got["int16"] == [(60001 + 2**15) % 2**16 - 2**15] * 5  # wraps as int16 does
            assert got["all_reduce"] == [3.0] * 4
            assert got["all_gather"] == [0.0, 0.0, 1.0, 1.0]
            assert got["reduce_scatter"] == [2.0 * rank]
            assert got["broadcast"] == [1.0, 1.0]
            assert got["all_to_all"] == [float(rank + 10 * r) for r in range(2)]
            assert got["counters"]["collectives"] == calls
        assert on["bits"] == off["bits"]
        assert on["counters"]["collectives_shm"] == calls
        assert on["counters"]["collectives_gloo"] == 0
        assert {t for _, t, _, _ in on["transports"]} == {"shm"}
        assert off["counters"]["collectives_shm"] == 0
        assert off["counters"]["collectives_gloo"] == calls
        assert {(t, r) for _, t, r, _ in off["transports"]} == {("gloo", "rank 0: DS_CPU_SHM=0")}
    # every rank the same bits (a reduce-scatter or an all-to-all leaves each rank its own)
    same = [k for k in runs["1"][0]["bits"] if not k.startswith(("reduce_scatter", "all_to"))]
    assert [runs["1"][0]["bits"][k] for k in same] == [runs["1"][1]["bits"][k] for k in same]


@pytest.mark.slow
def test_the_link_model_makes_a_collective_take_its_modelled_time(rank_pools: RankPools) -> None:
    # 32 MiB all-reduce on 2 ranks at 2 GB/s: a ring sends 32 MiB per rank, about 16.8 ms.
    env = {**backend_env("sim", 2), "DS_SIM_LINK_GBPS": "2", "DS_SIM_LATENCY_US": "50"}
    for ms, modelled in rank_pools.get(2, env).run(f"{JOBS}:link_job"):
        ratio = ms / (modelled * 1e3)
        # The stream is held at least for the modelled time; the real copy and gloo time
        # come on top, so the upper bound is generous.
        assert 0.95 <= ratio <= 20, (ms, modelled)


def test_wire_bytes_follow_a_ring() -> None:
    from ds_backend_sim.work import wire_bytes

    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("broadcast", 1000, 4) == 1000
    assert wire_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("gossip", 1, 2)
