"""Rank-side jobs of tests/backends/test_sim_comm.py, run on the session's rank pools
(tests/rankpool.py: ``rank_pools.get(world, env).run("tests.backends._sim_comm_worker:JOB")``).

The pool's ranks already hold the sim backend's process group (``ds_core.init_distributed``
with ``DS_ACCELERATOR=sim``: simccl, ``collectives.PROCESS_GROUP_BACKEND``); each job calls
``torch.distributed`` directly, as the test's spawned ranks did before, and first waits for the
previous job's work and zeroes the counters it reads, since a pool's ranks serve many jobs.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from ds_backend_sim import collectives, counters, device, reset_counters, work


def _fresh(rank: int) -> str:
    """This rank's device, with the counters zeroed once earlier jobs' work has finished."""
    d = f"sim:{rank % device.device_count()}"
    device.synchronize(rank % device.device_count())
    dist.barrier()  # host-side: not counted as a sim collective
    reset_counters()
    return d


def collectives_job() -> dict[str, Any]:
    """Every collective once on sim tensors, and the counters it left."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = _fresh(rank)
    got: dict[str, Any] = {}
    x = torch.full((4,), float(rank + 1), device=d)
    dist.all_reduce(x)
    got["all_reduce"] = x.tolist()
    y = torch.full((2,), float(rank + 1), device=d)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    got["max"] = y.tolist()
    out_ = torch.empty(2 * world, device=d)
    dist.all_gather_single(out_, torch.full((2,), float(rank), device=d))
    got["all_gather"] = out_.tolist()
    rs = torch.empty(1, device=d)
    dist.reduce_scatter_single(rs, torch.arange(float(world), device=d))
    got["reduce_scatter"] = rs.tolist()
    b = torch.full((2,), float(rank), device=d)
    dist.broadcast(b, world - 1)
    got["broadcast"] = b.tolist()
    a2a = torch.arange(float(world), device=d) + 10 * rank
    o2 = torch.empty(world, device=d)
    dist.all_to_all_single(o2, a2a)
    got["all_to_all"] = o2.tolist()
    w = dist.all_reduce(torch.ones(3, device=d).mul_(rank), async_op=True)
    assert w is not None
    w.wait()
    got["async"] = w.result()[0].tolist()
    even = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        z = torch.ones(2, device=d)
        dist.all_reduce(z, group=even)
        got["subgroup"] = z.tolist()
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, rank)
    got["objects"] = objs
    dist.barrier()
    # the sub-group stays, as other pool jobs' groups do: simccl's process groups carry no
    # name, which torch's destroy_process_group(group) needs
    got["counters"] = counters()
    return got


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def transports_job() -> dict[str, Any]:
    """The collectives on two ranks, several slot-sized pieces and one, with each result's bits
    and the transport that ran (the pool's ``DS_CPU_SHM`` picks it)."""
    rank = dist.get_rank()
    d = _fresh(rank)
    g = torch.Generator().manual_seed(1234 + rank)
    got: dict[str, Any] = {}
    bits: dict[str, str] = {}
    for dtype in (torch.float32, torch.bfloat16):
        # 3000 elements: several pieces of the 4 KiB slots the test sets, a two-step
        # all-reduce; 7 elements: the single-step one
        for n in (7, 3000):
            key = f"{dtype}-{n}"
            x = torch.randn(2 * n, generator=g).to(dtype).to(d)
            y = x.clone()
            dist.all_reduce(y)
            bits["all_reduce-" + key] = _digest(y)
            y = x.clone()
            dist.all_reduce(y, op=dist.ReduceOp.AVG)
            bits["avg-" + key] = _digest(y)
            o = torch.empty(4 * n, dtype=dtype, device=d)
            dist.all_gather_into_tensor(o, x)
            bits["all_gather-" + key] = _digest(o)
            o = torch.empty(n, dtype=dtype, device=d)
            dist.reduce_scatter_tensor(o, x)
            bits["reduce_scatter-" + key] = _digest(o)
            y = x.clone()
            dist.broadcast(y, 1)
            bits["broadcast-" + key] = _digest(y)
            o = torch.empty(2 * n, dtype=dtype, device=d)
            dist.all_to_all_single(o, x)
            bits["all_to_all-" + key] = _digest(o)
    i = torch.full((5,), 30000 + rank, dtype=torch.int16, device=d)
    dist.all_reduce(i)
    got["int16"] = i.tolist()
    x = torch.full((4,), float(rank + 1), device=d)
    dist.all_reduce(x)
    got["all_reduce"] = x.tolist()
    o = torch.empty(4, device=d)
    dist.all_gather_into_tensor(o, torch.full((2,), float(rank), device=d))
    got["all_gather"] = o.tolist()
    rs = torch.empty(1, device=d)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0, device=d))
    got["reduce_scatter"] = rs.tolist()
    b = torch.full((2,), float(rank), device=d)
    dist.broadcast(b, 1)
    got["broadcast"] = b.tolist()
    o = torch.empty(2, device=d)
    dist.all_to_all_single(o, torch.arange(2.0, device=d) + 10 * rank)
    got["all_to_all"] = o.tolist()
    device.synchronize(rank)
    got["counters"] = counters()
    got["transports"] = sorted(
        [c, t, r, n] for (c, t, r), n in collectives.transport_counts().items()
    )
    got["bits"] = bits
    return got


def link_job() -> tuple[float, float]:
    """Milliseconds a 32 MiB all-reduce holds the stream (mean of 3, after a warm-up), and
    the link model's seconds for it."""
    rank = dist.get_rank()
    d = _fresh(rank)
    t = torch.ones(8 << 20, device=d)
    dist.all_reduce(t)
    device.synchronize(rank)
    start = device.Event(enable_timing=True)
    end = device.Event(enable_timing=True)
    start.record(device.current_stream(rank))
    for _ in range(3):
        dist.all_reduce(t)
    end.record(device.current_stream(rank))
    end.synchronize()
    ms = start.elapsed_time(end) / 3
    return ms, work.modelled_seconds("all_reduce", t.numel() * 4, 2)
