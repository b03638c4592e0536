"""Collectives through the facade on 2 real gloo ranks: the core's defaults and the CPU overrides."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.rankpool import free_port, rank_env

WORLD = 2


def _ranks(rank: int, port: int, errors: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        os.environ.update(rank_env(rank, WORLD, port, DS_ACCELERATOR="cpu"))
        torch.set_num_threads(1)
        import ds_core
        from ds_core import comm

        ds_core.init_distributed(timeout=60)
        acc = ds_core.get_accelerator()
        assert acc.current_device() == rank
        r = float(rank + 1)  # rank values 1, 2

        # int16 is missing from gloo; the cpu backend's hooks cover it
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int16):
            t = torch.full((7,), r, dtype=dtype)
            acc.all_reduce(t)  # sum
            torch.testing.assert_close(t, torch.full((7,), 3.0).to(dtype))
        t = torch.full((5,), r)
        acc.all_reduce(t, op="avg")
        torch.testing.assert_close(t, torch.full((5,), 1.5))
        t = torch.full((3,), r)
        work = acc.all_reduce(t, op="max", async_op=True)
        work.wait()
        torch.testing.assert_close(t, torch.full((3,), 2.0))

        # reduce-scatter: input row i on rank k holds (k+1)*(i+1); rank k keeps row k summed
        inp = torch.stack([torch.full((3,), r * (i + 1)) for i in range(WORLD)])
        out = torch.empty(3)
        acc.reduce_scatter(out, inp.clone())
        torch.testing.assert_close(out, torch.full((3,), 3.0 * (rank + 1)))
        out = torch.empty(3)
        acc.reduce_scatter(out, inp.clone(), op="avg", async_op=True).wait()
        torch.testing.assert_close(out, torch.full((3,), 1.5 * (rank + 1)))
        with pytest.raises(ValueError, match="reduce_scatter input has 5 elements, expected 6"):
            acc.reduce_scatter(torch.empty(3), torch.empty(5))

        gathered = torch.empty(WORLD * 4)
        acc.all_gather(gathered, torch.full((4,), r))
        torch.testing.assert_close(gathered, torch.tensor([1.0] * 4 + [2.0] * 4))
        gathered = torch.empty(WORLD * 4, dtype=torch.int32)
        acc.all_gather(
            gathered, torch.full((4,), rank + 1, dtype=torch.int32), async_op=True
        ).wait()
        assert gathered.tolist() == [1] * 4 + [2] * 4
        flags = torch.empty(WORLD * 2, dtype=torch.bool)
        acc.all_gather(flags, torch.tensor([rank == 0, True]))
        assert flags.tolist() == [True, True, False, True]
        with pytest.raises(ValueError, match="all_gather output has 3 elements, expected 8"):
            acc.all_gather(torch.empty(3), torch.full((4,), r))

        b = torch.full((2,), r)
        acc.broadcast(b, src=1)
        torch.testing.assert_close(b, torch.full((2,), 2.0))
        b16 = torch.full((2,), rank + 1, dtype=torch.int16)
        acc.broadcast(b16, src=1, async_op=True).wait()
        assert b16.tolist() == [2, 2]
        g16 = torch.empty(WORLD * 2, dtype=torch.int16)
        acc.all_gather(g16, torch.full((2,), -(rank + 1), dtype=torch.int16))
        assert g16.tolist() == [-1, -1, -2, -2]
        rs16 = torch.empty(2, dtype=torch.int16)
        acc.reduce_scatter(rs16, torch.full((4,), 30000, dtype=torch.int16))
        assert rs16.tolist() == [60000 - 65536] * 2  # int16 wraps, exactly as int16 sums do
        a2a16 = torch.empty(2, dtype=torch.int16)
        acc.all_to_all(a2a16, torch.tensor([rank * 10, rank * 10 + 1], dtype=torch.int16))
        assert a2a16.tolist() == [rank, 10 + rank]

        # uneven all-to-all: rank 0 sends 1 row to rank 0 and 2 rows to rank 1; rank 1 sends 3, 1
        send_sizes = [[1, 2], [3, 1]][rank]
        recv_sizes = [send_sizes_of[rank] for send_sizes_of in ([1, 2], [3, 1])]
        inp = torch.full((sum(send_sizes),), r)
        out = torch.empty(sum(recv_sizes))
        acc.all_to_all(out, inp, recv_sizes, send_sizes)
        expected = torch.cat([torch.full((recv_sizes[k],), float(k + 1)) for k in range(WORLD)])
        torch.testing.assert_close(out, expected)

        group = comm.new_group([0, 1])
        t = torch.full((2,), r)
        acc.all_reduce(t, group=group)
        torch.testing.assert_close(t, torch.full((2,), 3.0))
        assert acc.barrier()

        # teardown releases ds_core's cached groups too, and may be called twice
        from ds_core.comm import groups

        released: list[bool] = []
        groups.on_destroy(lambda: released.append(True))
        groups.expert_groups(2)
        assert groups._expert_groups
        ds_core.destroy_distributed()
        assert not groups._expert_groups and not torch.distributed.is_initialized()
        assert released == [True]
        ds_core.destroy_distributed()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


@pytest.mark.slow
def test_collectives_on_two_gloo_ranks() -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ranks, args=(r, port, errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
