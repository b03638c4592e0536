"""simccl, the sim backend's collectives: every collective across real processes in both async
modes, bytes through the CPU backend's shared memory, the link model's time and wire bytes.
The device itself: test_sim.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytest.importorskip("ds_backend_sim")

from tests.backends.helpers import SIM_MODES as MODES

COLLECTIVES = """
import torch.distributed as dist, torch.multiprocessing as mp, socket
from ds_backend_sim import collectives

def rank_main(rank, world, port, q):
    try:
        device.init()
        dist.init_process_group(collectives.PROCESS_GROUP_BACKEND,
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        d = f"sim:{rank % device.device_count()}"
        got = {}
        x = torch.full((4,), float(rank + 1), device=d)
        dist.all_reduce(x); got["all_reduce"] = x.tolist()
        y = torch.full((2,), float(rank + 1), device=d)
        dist.all_reduce(y, op=dist.ReduceOp.MAX); got["max"] = y.tolist()
        out_ = torch.empty(2 * world, device=d)
        dist.all_gather_single(out_, torch.full((2,), float(rank), device=d)); got["all_gather"] = out_.tolist()
        rs = torch.empty(1, device=d)
        dist.reduce_scatter_single(rs, torch.arange(float(world), device=d)); got["reduce_scatter"] = rs.tolist()
        b = torch.full((2,), float(rank), device=d); dist.broadcast(b, world - 1); got["broadcast"] = b.tolist()
        a2a = torch.arange(float(world), device=d) + 10 * rank
        o2 = torch.empty(world, device=d); dist.all_to_all_single(o2, a2a); got["all_to_all"] = o2.tolist()
        w = dist.all_reduce(torch.ones(3, device=d).mul_(rank), async_op=True)
        w.wait(); got["async"] = w.result()[0].tolist()
        even = dist.new_group([r for r in range(world) if r % 2 == 0])
        if rank % 2 == 0:
            z = torch.ones(2, device=d); dist.all_reduce(z, group=even); got["subgroup"] = z.tolist()
        objs = [None] * world; dist.all_gather_object(objs, rank); got["objects"] = objs
        dist.barrier()
        got["counters"] = counters()
        q.put((rank, got))
        dist.destroy_process_group()
    except BaseException as e:
        import traceback; q.put((rank, {"error": traceback.format_exc()}))

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

if __name__ == "__main__" or True:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=rank_main, args=(r, WORLD, port, q)) for r in range(WORLD)]
    [p.start() for p in ps]
    res = dict(q.get(timeout=240) for _ in ps)
    [p.join(60) for p in ps]
    out(results={str(k): v for k, v in res.items()})
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_simccl_collectives_across_processes(world: int, mode: str, tmp_path: Any) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(
        "import json, torch\nfrom ds_backend_sim import device, counters\n"
        "def out(**kw):\n    print('RESULT ' + json.dumps(kw), flush=True)\n"
        f"WORLD = {world}\n"
        + COLLECTIVES.replace('if __name__ == "__main__" or True:', 'if __name__ == "__main__":')
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    env["DS_SIM_ASYNC"] = mode
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT ") :])["results"]
    total = float(sum(range(1, world + 1)))
    for rank in range(world):
        got = results[str(rank)]
        assert "error" not in got, got.get("error")
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


TRANSPORTS = """
import hashlib, json, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
from ds_backend_sim import device, collectives, counters

def digest(t):
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

def rank_main(rank, port, q):
    try:
        device.init()
        dist.init_process_group(collectives.PROCESS_GROUP_BACKEND,
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        d = f"sim:{rank}"
        g = torch.Generator().manual_seed(1234 + rank)
        got, bits = {}, {}
        for dtype in (torch.float32, torch.bfloat16):
            # 3000 elements: several pieces of the 4 KiB slots the test sets, a two-step
            # all-reduce; 7 elements: the single-step one
            for n in (7, 3000):
                key = f"{dtype}-{n}"
                x = torch.randn(2 * n, generator=g).to(dtype).to(d)
                y = x.clone(); dist.all_reduce(y); bits["all_reduce-" + key] = digest(y)
                y = x.clone(); dist.all_reduce(y, op=dist.ReduceOp.AVG); bits["avg-" + key] = digest(y)
                o = torch.empty(4 * n, dtype=dtype, device=d)
                dist.all_gather_into_tensor(o, x); bits["all_gather-" + key] = digest(o)
                o = torch.empty(n, dtype=dtype, device=d)
                dist.reduce_scatter_tensor(o, x); bits["reduce_scatter-" + key] = digest(o)
                y = x.clone(); dist.broadcast(y, 1); bits["broadcast-" + key] = digest(y)
                o = torch.empty(2 * n, dtype=dtype, device=d)
                dist.all_to_all_single(o, x); bits["all_to_all-" + key] = digest(o)
        i = torch.full((5,), 30000 + rank, dtype=torch.int16, device=d)
        dist.all_reduce(i); got["int16"] = i.tolist()
        x = torch.full((4,), float(rank + 1), device=d)
        dist.all_reduce(x); got["all_reduce"] = x.tolist()
        o = torch.empty(4, device=d)
        dist.all_gather_into_tensor(o, torch.full((2,), float(rank), device=d))
        got["all_gather"] = o.tolist()
        rs = torch.empty(1, device=d)
        dist.reduce_scatter_tensor(rs, torch.arange(2.0, device=d)); got["reduce_scatter"] = rs.tolist()
        b = torch.full((2,), float(rank), device=d); dist.broadcast(b, 1); got["broadcast"] = b.tolist()
        o = torch.empty(2, device=d)
        dist.all_to_all_single(o, torch.arange(2.0, device=d) + 10 * rank); got["all_to_all"] = o.tolist()
        device.synchronize(rank)
        got["counters"] = counters()
        got["transports"] = sorted(
            [c, t, r, n] for (c, t, r), n in collectives.transport_counts().items())
        got["bits"] = bits
        q.put((rank, got))
        dist.destroy_process_group()
    except BaseException:
        import traceback; q.put((rank, {"error": traceback.format_exc()}))

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, port, q)) for r in range(2)]
    [p.start() for p in ps]
    res = dict(q.get(timeout=240) for _ in ps)
    [p.join(60) for p in ps]
    print("RESULT " + json.dumps({str(k): v for k, v in res.items()}))
"""


@pytest.mark.slow
def test_simccl_moves_bytes_through_the_cpu_backends_shared_memory(tmp_path: Any) -> None:
    # The same calls with the CPU backend's transport on and off (DS_CPU_SHM=0): the transport
    # that ran is reported, and both give the same bits (both reduce in rank order).
    script = tmp_path / "transports.py"
    script.write_text(TRANSPORTS)
    runs = {}
    for shm, mode in (("1", "threads"), ("0", "lazy")):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_SIM_", "DS_CPU_"))}
        env.update(DS_SIM_ASYNC=mode, DS_CPU_SHM=shm, DS_CPU_SHM_SLOT_BYTES="4096")
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        runs[shm] = json.loads(lines[-1][len("RESULT ") :])
    calls = 2 * 2 * 6 + 6  # (dtypes x sizes x collectives) + the value checks
    for rank in ("0", "1"):
        on, off = runs["1"][rank], runs["0"][rank]
        assert "error" not in on, on.get("error")
        assert "error" not in off, off.get("error")
        for got in (on, off):
            assert got["int16"] == [(60001 + 2**15) % 2**16 - 2**15] * 5  # wraps as int16 does
            assert got["all_reduce"] == [3.0] * 4
            assert got["all_gather"] == [0.0, 0.0, 1.0, 1.0]
            assert got["reduce_scatter"] == [2.0 * int(rank)]
            assert got["broadcast"] == [1.0, 1.0]
            assert got["all_to_all"] == [float(int(rank) + 10 * r) for r in range(2)]
            assert got["counters"]["collectives"] == calls
        assert on["bits"] == off["bits"]
        assert on["counters"]["collectives_shm"] == calls
        assert on["counters"]["collectives_gloo"] == 0
        assert {t for _, t, _, _ in on["transports"]} == {"shm"}
        assert off["counters"]["collectives_shm"] == 0
        assert off["counters"]["collectives_gloo"] == calls
        assert {(t, r) for _, t, r, _ in off["transports"]} == {("gloo", "rank 0: DS_CPU_SHM=0")}
    # every rank the same bits (a reduce-scatter or an all-to-all leaves each rank its own)
    same = [k for k in runs["1"]["0"]["bits"] if not k.startswith(("reduce_scatter", "all_to"))]
    assert [runs["1"]["0"]["bits"][k] for k in same] == [runs["1"]["1"]["bits"][k] for k in same]


@pytest.mark.slow
def test_the_link_model_makes_a_collective_take_its_modelled_time(tmp_path: Any) -> None:
    # 32 MiB all-reduce on 2 ranks at 2 GB/s: a ring sends 32 MiB per rank, about 16.8 ms.
    script = tmp_path / "link.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
            from ds_backend_sim import device, collectives, work

            def rank_main(rank, port, q):
                device.init()
                dist.init_process_group(collectives.PROCESS_GROUP_BACKEND,
                    init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
                t = torch.ones(8 << 20, device=f"sim:{rank}")
                dist.all_reduce(t); device.synchronize(rank)
                start = device.Event(enable_timing=True); end = device.Event(enable_timing=True)
                start.record(device.current_stream(rank))
                for _ in range(3):
                    dist.all_reduce(t)
                end.record(device.current_stream(rank)); end.synchronize()
                ms = start.elapsed_time(end) / 3
                q.put((rank, ms, work.modelled_seconds("all_reduce", t.numel() * 4, 2)))
                dist.destroy_process_group()

            if __name__ == "__main__":
                s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
                ctx = mp.get_context("spawn"); q = ctx.Queue()
                ps = [ctx.Process(target=rank_main, args=(r, port, q)) for r in range(2)]
                [p.start() for p in ps]
                res = [q.get(timeout=240) for _ in ps]
                [p.join(60) for p in ps]
                print("RESULT " + json.dumps(res))
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    env.update(DS_SIM_LINK_GBPS="2", DS_SIM_LATENCY_US="50")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    for _rank, ms, modelled in json.loads(lines[-1][len("RESULT ") :]):
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
