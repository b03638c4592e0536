"""The CPU backend: launcher-derived devices, memory capped by the process's limits, streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ds_backend_cpu import memory
from ds_backend_cpu import plugin as cpu

MiB = 1 << 20


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_devices_follow_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(cpu._host, "_current", None)
    assert cpu.ds_device_count() == 4
    assert cpu.ds_device_current() == 3
    cpu.ds_device_set(1)
    assert cpu.ds_device_current() == 1
    with pytest.raises(ValueError, match=r"device index 4 is out of range: .* 4 cpu device\(s\)"):
        cpu.ds_device_set(4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cpu.ds_device_count() == 1


def test_memory_under_rlimit_as_is_capped_by_the_limit() -> None:
    out = run_python(
        """
        import json, resource
        limit = 6 * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        import ds_core
        acc = ds_core.get_accelerator()
        info = acc.memory_info()
        print(json.dumps({"limit": limit, "total": acc.total_memory(),
                          "available": acc.available_memory(),
                          "reported_limit": info.limit, "source": info.limit_source}))
        """,
        DS_ACCELERATOR="cpu",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["total"] <= got["limit"]
    assert 0 < got["available"] <= got["limit"]
    assert got["reported_limit"] == got["limit"] and got["source"] == "RLIMIT_AS"


def test_available_under_rlimit_as_subtracts_the_address_space_in_use() -> None:
    status = "VmSize:\t1048576 kB\nVmData:\t524288 kB\n"
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (8 * 2**30, hard))
        limits = {lim.source: lim for lim in memory.rlimits(status)}
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    assert limits["RLIMIT_DATA"].limit == 8 * 2**30
    assert limits["RLIMIT_DATA"].used == 512 * MiB


def _cgroup(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp


def test_cgroup_v2_memory_max_of_the_process_cgroup(tmp_path: Path) -> None:
    root = _cgroup(
        tmp_path,
        {"job/memory.max": str(2 * 2**30), "job/memory.current": str(512 * MiB)},
    )
    (lim,) = memory.cgroup_limits(root, "0::/job\n")
    assert (lim.source, lim.limit, lim.used) == ("cgroup v2 memory.max", 2 * 2**30, 512 * MiB)
    _cgroup(tmp_path, {"job/memory.max": "max"})
    assert memory.cgroup_limits(root, "0::/job\n") == []


def test_cgroup_v1_limit_in_bytes_and_its_unlimited_value(tmp_path: Path) -> None:
    root = _cgroup(
        tmp_path,
        {
            "memory/box/memory.limit_in_bytes": str(3 * 2**30),
            "memory/box/memory.usage_in_bytes": str(MiB),
        },
    )
    (lim,) = memory.cgroup_limits(root, "4:memory:/box\n")
    assert (lim.source, lim.limit, lim.used) == ("cgroup v1 memory.limit_in_bytes", 3 * 2**30, MiB)
    # "unlimited" stays a limit, above any host's memory: memory_info never takes it
    _cgroup(tmp_path, {"memory/box/memory.limit_in_bytes": "9223372036854771712"})
    (lim,) = memory.cgroup_limits(root, "4:memory:/box\n")
    assert lim.limit == 9223372036854771712 > memory.host_total()


def test_cgroup_limits_of_every_ancestor_and_paths_with_colons(tmp_path: Path) -> None:
    job = "kubepods.slice/pod-1.slice/cri-containerd:0f3a.scope"
    root = _cgroup(
        tmp_path,
        {
            f"{job}/memory.max": "max",
            f"{job}/memory.current": str(MiB),
            "kubepods.slice/pod-1.slice/memory.max": str(2 * 2**30),
            "kubepods.slice/pod-1.slice/memory.current": str(3 * MiB),
            "memory.max": str(4 * 2**30),  # a container's own cgroup mounted as the root
        },
    )
    limits = memory.cgroup_limits(root, f"0::/{job}\n")
    assert sorted((lim.limit, lim.used) for lim in limits) == [(2 * 2**30, 3 * MiB), (4 * 2**30, 0)]
    # a path that does not exist under the mount (the container's view): the root still binds
    assert [lim.limit for lim in memory.cgroup_limits(root, "0::/elsewhere/job\n")] == [4 * 2**30]


def test_memory_info_takes_the_lowest_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "host_total", lambda: 64 * 2**30)
    monkeypatch.setattr(memory, "host_available", lambda: 60 * 2**30)
    monkeypatch.setattr(
        memory, "rlimits", lambda: [memory.Limit("RLIMIT_AS", 16 * 2**30, 2 * 2**30)]
    )
    monkeypatch.setattr(
        memory,
        "cgroup_limits",
        lambda: [memory.Limit("cgroup v2 memory.max", 8 * 2**30, 7 * 2**30)],
    )
    total, available, binding = memory.memory_info()
    assert total == 8 * 2**30 and binding is not None and binding.source == "cgroup v2 memory.max"
    assert available == 2**30  # the cgroup has 1 GiB left, less than the rlimit's 14 GiB


def test_allocated_tracks_a_written_tensor_and_peak_resets() -> None:
    out = run_python(
        """
        import json, torch
        import ds_core
        acc = ds_core.get_accelerator()
        before = acc.memory_allocated()
        t = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
        during = acc.memory_allocated()
        peak = acc.max_memory_allocated()
        del t
        after = acc.memory_allocated()
        reset = acc.reset_peak_memory_stats()
        print(json.dumps(dict(before=before, during=during, peak=peak, after=after,
                              reset=reset, peak_after=acc.max_memory_allocated())))
        """,
        DS_ACCELERATOR="cpu",
        MALLOC_MMAP_THRESHOLD_="65536",
    )
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    assert m["during"] - m["before"] >= 60 * MiB
    assert m["peak"] >= m["during"]
    assert m["during"] - m["after"] >= 60 * MiB
    if m["reset"]:
        assert m["peak_after"] < m["peak"] - 32 * MiB


def test_events_time_with_the_host_clock() -> None:
    start, end = cpu.ds_stream_event_create(True), cpu.ds_stream_event_create(True)
    start.record()
    torch.ones(256, 256) @ torch.ones(256, 256)
    end.record()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        cpu.ds_stream_event_create(False).elapsed_time(end)
    with pytest.raises(RuntimeError, match="recorded first"):
        cpu.ds_stream_event_create(True).elapsed_time(end)


def test_stream_context_makes_the_stream_current_and_restores() -> None:
    side = cpu.ds_stream_create(None, 0)
    default = cpu.ds_stream_current(None)
    with cpu.ds_stream_use(side):
        assert cpu.ds_stream_current(None) is side
    assert cpu.ds_stream_current(None) is default


def test_rng_state_round_trip() -> None:
    cpu.ds_rng_manual_seed(7, True)
    state = cpu.ds_rng_get_state(None)
    first = torch.rand(5)
    cpu.ds_rng_set_state(state, None)
    assert torch.equal(first, torch.rand(5))


def test_determinism_record_names_what_it_set_and_restores() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    record = cpu.ds_determinism_apply(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert record.settings["torch.use_deterministic_algorithms"] == (before, True)
    cpu.ds_determinism_restore(record)
    assert torch.are_deterministic_algorithms_enabled() == before
