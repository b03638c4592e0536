"""The simulated accelerator (backend ``sim``): a device that is not the host.

Each scenario runs in a fresh process, because the async mode, the device count and the
capacity are fixed when the device is created. Multi-rank scenarios spawn real processes
over simccl. Timing claims are ratios, never wall-clock thresholds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytest.importorskip("ds_backend_sim")

MODES = ("threads", "lazy")


def run(code: str, mode: str = "threads", timeout: float = 300, **env: str) -> dict[str, Any]:
    """Run ``code`` (which calls ``out(**values)``) in a new process; return the values."""
    prelude = textwrap.dedent(
        """
        import json, sys, torch
        from ds_backend_sim import device, counters, reset_counters
        def out(**kw):
            print("RESULT " + json.dumps(kw), flush=True)
        """
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    full_env.update({"DS_SIM_ASYNC": mode, **env})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


@pytest.mark.parametrize("mode", MODES)
def test_a_sim_tensor_is_not_a_host_tensor(mode: str) -> None:
    r = run(
        """
        sim = device.init()
        x = torch.arange(4.0, device="sim")
        try:
            x + torch.ones(4)
            mixed = ""
        except RuntimeError as e:
            mixed = str(e)
        try:
            x.numpy()
            numpy = ""
        except TypeError as e:
            numpy = str(e)
        scalar_ok = (x + torch.tensor(1.0)).tolist()  # a 0-dim host tensor is a scalar
        out(mixed=mixed, numpy=numpy, is_sim=x.is_sim, device=str(x.device), scalar=scalar_ok,
            module=str(torch.nn.Linear(2, 2).to("sim:1").weight.device))
        """,
        mode,
    )
    assert "Expected all tensors to be on the same device" in r["mixed"]
    assert "sim:0 and cpu" in r["mixed"]
    assert "can't convert sim:0" in r["numpy"]
    assert r["is_sim"] and r["device"] == "sim:0" and r["module"] == "sim:1"
    assert r["scalar"] == [1.0, 2.0, 3.0, 4.0]


def test_out_of_memory_names_the_device_and_the_run_survives() -> None:
    r = run(
        """
        sim = device.init()
        a = torch.empty(6 << 20, dtype=torch.uint8, device="sim")
        try:
            torch.empty(4 << 20, dtype=torch.uint8, device="sim")
            msg = ""
        except torch.OutOfMemoryError as e:
            msg = str(e)
        kept = a.fill_(3)[:4].tolist()
        del a
        b = torch.empty(4 << 20, dtype=torch.uint8, device="sim")
        out(msg=msg, kept=kept, after=sim.memory_allocated(), stats=sim.memory_stats())
        """,
        DS_SIM_MEMORY_MB="8",
    )
    assert "sim:0 out of memory: tried to allocate 4194304 bytes" in r["msg"]
    assert "2097152 bytes (2.00 MiB) are free" in r["msg"]
    assert "DS_SIM_MEMORY_MB" in r["msg"]
    assert r["kept"] == [3, 3, 3, 3]
    assert 4 << 20 <= r["after"] <= 6 << 20  # the freed 6 MiB block may be reused whole
    assert r["stats"]["num_ooms"] == 1


def test_peaks_follow_the_allocations_and_reset() -> None:
    r = run(
        """
        sim = device.init()
        base = sim.memory_allocated()
        a = torch.empty(1 << 20, dtype=torch.uint8, device="sim")
        b = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
        del b
        peak = sim.max_memory_allocated() - base
        now = sim.memory_allocated() - base
        reserved = sim.memory_reserved()
        sim.reset_peak_memory_stats()
        after_reset = sim.max_memory_allocated() - base
        sim.empty_cache()
        out(peak=peak, now=now, reserved=reserved, after_reset=after_reset,
            reserved_after_empty=sim.memory_reserved(), free_total=list(sim.mem_get_info()),
            other=sim.memory_allocated(1))
        """
    )
    assert r["peak"] == 4 << 20 and r["now"] == 1 << 20
    assert r["reserved"] >= 4 << 20
    assert r["after_reset"] == 1 << 20
    assert r["reserved_after_empty"] == 1 << 20
    assert r["free_total"] == [(4096 << 20) - (1 << 20), 4096 << 20]
    assert r["other"] == 0


def test_a_reused_larger_block_counts_only_the_request_as_allocated() -> None:
    """A cached 4 MiB block serving a 3 MiB request is 3 MiB allocated and 4 MiB reserved, as
    CUDA's allocator (which splits the block) reports it; counting the whole block overstated
    stage 3's memory by a shard per unit (FlatUnit frees a gathered buffer, the next shard
    reuses it)."""
    r = run(
        """
        sim = device.init()
        base, base_reserved = sim.memory_allocated(), sim.memory_reserved()
        a = torch.empty(4 << 20, dtype=torch.uint8, device="sim")
        del a
        b = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
        out(allocated=sim.memory_allocated() - base,
            reserved=sim.memory_reserved() - base_reserved)
        """
    )
    assert r["allocated"] == 3 << 20, r
    assert r["reserved"] == 4 << 20, r


def test_non_blocking_copies_from_pinned_memory_are_queued_and_from_pageable_are_not() -> None:
    # Lazy mode: a queued copy runs when something waits for it, so a host write to its
    # source before that wait shows in the result, every time.
    r = run(
        """
        sim = device.init()
        pinned = torch.zeros(4).pin_memory()
        pageable = torch.zeros(4)
        d1 = torch.empty(4, device="sim"); d2 = torch.empty(4, device="sim")
        reset_counters()
        # The pageable copy goes first: a blocking copy orders the host after everything
        # queued on the stream before it, which would run the pinned copy too.
        d2.copy_(pageable, non_blocking=True)
        d1.copy_(pinned, non_blocking=True)
        syncs_after_copies = counters()["host_syncs"]
        pinned.fill_(7.0); pageable.fill_(7.0)
        out(pinned=d1.tolist(), pageable=d2.tolist(), syncs=syncs_after_copies,
            is_pinned=[pinned.is_pinned(), pageable.is_pinned()])
        """,
        "lazy",
    )
    assert r["pinned"] == [7.0] * 4  # queued: read after the host wrote
    assert r["pageable"] == [0.0] * 4  # synchronous, as on CUDA
    assert r["syncs"] == 1  # only the pageable copy blocked the host
    assert r["is_pinned"] == [True, False]


@pytest.mark.parametrize("mode", MODES)
def test_a_missing_stream_wait_is_caught_in_lazy_mode(mode: str) -> None:
    r = run(
        """
        sim = device.init()
        src = torch.full((4,), 5.0).pin_memory()
        side = sim.Stream()
        results = {}
        for waited in (False, True):
            dst = torch.zeros(4, device="sim")
            with sim.stream(side):
                dst.copy_(src, non_blocking=True)
            if waited:
                sim.current_stream().wait_stream(side)
            results[str(waited)] = (dst * 2).tolist()
            sim.synchronize()
        out(**results)
        """,
        mode,
    )
    assert r["True"] == [10.0] * 4
    if mode == "lazy":
        assert r["False"] == [0.0] * 4  # the copy on the side stream had not run


def test_copies_across_devices_and_rng_per_device() -> None:
    r = run(
        """
        sim = device.init()
        a = torch.arange(6.0, device="sim:0")
        b = a.to("sim:1")
        c = b.view(2, 3).t().to("sim:0")
        sim.manual_seed_all(3)
        d0 = torch.randn(4, device="sim:0").tolist()
        d1 = torch.randn(4, device="sim:1").tolist()
        state = sim.get_rng_state("sim:0")
        x = torch.randn(4, device="sim:0").tolist()
        torch.manual_seed(123)  # the host's generator is not the device's
        sim.set_rng_state(state, "sim:0")
        y = torch.randn(4, device="sim:0").tolist()
        gen = sim.default_generators[1]
        out(b=b.tolist(), bdev=str(b.device), c=c.tolist(), same_seed=d0 == d1, x=x, y=y,
            gen_device=str(gen.device))
        """
    )
    assert r["b"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and r["bdev"] == "sim:1"
    assert r["c"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert r["same_seed"]  # same seed on both devices: same draws
    assert r["x"] == r["y"]
    assert r["gen_device"] == "sim:1"


def test_an_event_takes_its_device_at_its_first_record() -> None:
    """As a CUDA event: made while sim:0 is current, it may first be recorded on sim:1's
    stream (a rank that never set its device does this), and is then sim:1's."""
    r = run(
        """
        device.init()
        errors = []
        for timing in (True, False):
            e = device.Event(enable_timing=timing)
            e.record(device.current_stream(1))
            e.synchronize()
            try:
                e.record(device.current_stream(0))
            except RuntimeError as exc:
                errors.append(str(exc))
        out(errors=errors)
        """,
        DS_SIM_DEVICES="2",
    )
    assert len(r["errors"]) == 2, r
    assert all(
        "an event of sim:1 cannot be recorded on a stream of sim:0" in e for e in r["errors"]
    )


def test_torch_manual_seed_seeds_the_device_without_creating_it() -> None:
    # torch.manual_seed seeds every registered device module, as it does CUDA's: before the
    # device exists the seed is kept for init() rather than creating the device.
    r = run(
        """
        from ds_backend_sim.device import name_device_type, is_initialized
        name_device_type()  # what a selection probe does: torch.sim exists, no device yet
        torch.manual_seed(7)
        created = is_initialized()
        device.init()
        a = torch.randn(4, device="sim:0").tolist()
        b = torch.randn(4, device="sim:1").tolist()
        torch.manual_seed(7)
        c = torch.randn(4, device="sim:0").tolist()
        out(created=created, a=a, b=b, c=c)
        """
    )
    assert not r["created"]
    assert r["a"] == r["b"] == r["c"]


def test_counters_are_exact_for_a_scripted_sequence() -> None:
    r = run(
        """
        sim = device.init()
        host = torch.ones(256)  # 1 KiB
        pinned = torch.ones(256).pin_memory()
        reset_counters()
        d = host.to("sim")                      # blocking H2D: 1 sync, 1024 bytes
        e = torch.empty(256, device="sim")
        e.copy_(pinned, non_blocking=True)      # queued H2D: 1024 bytes, no sync
        f = d + e                               # 1 kernel
        f.sum().item()                          # 1 kernel, 1 sync, 4 bytes
        back = torch.empty(256).pin_memory()
        back.copy_(f, non_blocking=True)        # queued D2H: 1024 bytes, no sync
        sim.synchronize()                       # 1 sync
        out(counters=counters(), value=back[0].item())
        """
    )
    assert r["counters"] == {
        "host_syncs": 3,
        "h2d_bytes": 2048,
        "d2h_bytes": 1028,
        "kernels": 2,
        "collectives": 0,
        "collective_bytes": 0,
        "collectives_shm": 0,
        "collectives_gloo": 0,
    }
    assert r["value"] == 2.0


@pytest.mark.parametrize(
    ("env", "text"),
    [
        ({"DS_SIM_ASYNC": "eager"}, "DS_SIM_ASYNC='eager' must be 'threads'"),
        ({"DS_SIM_DEVICES": "0"}, "DS_SIM_DEVICES='0' is out of range"),
        ({"DS_SIM_MEMORY_MB": "lots"}, "DS_SIM_MEMORY_MB='lots' is not an integer"),
        ({"DS_SIM_LINK_GBPS": "-1"}, "DS_SIM_LINK_GBPS='-1' is out of range"),
        ({"DS_SIM_DEVICE": "2"}, "unknown variable(s) DS_SIM_DEVICE"),
    ],
)
def test_bad_settings_are_refused_before_any_work(env: dict[str, str], text: str) -> None:
    from ds_backend_sim import device

    from ds_core.errors import ConfigError

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(ConfigError) as info:
            device.settings()
        assert text in str(info.value)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_device_index_out_of_range_is_refused() -> None:
    r = run(
        """
        sim = device.init()
        try:
            torch.empty(1, device="sim:5")
            msg = ""
        except RuntimeError as e:
            msg = str(e)
        out(msg=msg)
        """
    )
    assert "sim:5 is out of range: this process has 2 sim device(s)" in r["msg"]


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
