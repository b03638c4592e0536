"""The simulated accelerator (backend ``sim``): a device that is not the host.

Each scenario runs in a fresh process, because the async mode, the device count and the
capacity are fixed when the device is created. Multi-rank scenarios spawn real processes
over simccl. Timing claims are ratios, never wall-clock thresholds.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ds_backend_sim")

from tests.backends.helpers import SIM_MODES as MODES
from tests.backends.helpers import run_in_sim_process as run


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
