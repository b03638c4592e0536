"""Memory queries follow real allocations; capacity honours the process's limits; pinning."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from ds_conformance.helpers import MiB, check, run_python
from ds_conformance.marks import capability, hooks, tier

pytestmark = tier("basic")

# Large enough to stand out of an allocator's or a resident set's noise, written so the
# pages are really touched (DESIGN.md §3: CPU memory tests use ≥ 64 MiB written tensors).
SIZE = 64 * MiB


def _alloc(acc: Any, nbytes: int) -> torch.Tensor:
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=acc.device())
    acc.synchronize()
    return t


def _free(acc: Any) -> None:
    gc.collect()
    acc.synchronize()
    acc.empty_cache()


@hooks("ds_memory_allocated", "ds_memory_empty_cache")
def test_allocated_grows_with_a_tensor_and_falls_when_freed(acc: Any) -> None:
    _free(acc)
    before = acc.memory_allocated()
    t = _alloc(acc, SIZE)
    during = acc.memory_allocated()
    check(
        during - before >= SIZE // 2,
        "memory_allocated() growth (bytes)",
        during - before,
        f"≥ {SIZE // 2} after allocating {SIZE}",
        "ds_memory_allocated",
    )
    del t
    _free(acc)
    after = acc.memory_allocated()
    check(
        during - after >= SIZE // 2,
        "memory_allocated() drop (bytes)",
        during - after,
        f"≥ {SIZE // 2} after freeing {SIZE}",
        "ds_memory_allocated + empty_cache",
    )


@hooks("ds_memory_max_allocated", "ds_memory_reset_peak")
def test_peak_is_at_least_current_and_resets(acc: Any) -> None:
    _free(acc)
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    t = _alloc(acc, 2 * SIZE)
    del t
    _free(acc)
    peak = acc.max_memory_allocated()
    current = acc.memory_allocated()
    check(
        peak >= current,
        "max_memory_allocated()",
        peak,
        f"≥ memory_allocated()={current}",
        "ds_memory_max_allocated",
    )
    check(
        peak - base >= SIZE,
        "peak growth (bytes)",
        peak - base,
        f"≥ {SIZE} after a {2 * SIZE}-byte tensor",
        "ds_memory_max_allocated",
    )
    if not acc.reset_peak_memory_stats():
        pytest.skip("the platform forbids resetting the peak (ds_memory_reset_peak returned False)")
    reset = acc.max_memory_allocated()
    check(
        reset <= peak - SIZE,
        "max_memory_allocated() after reset",
        reset,
        f"≤ {peak - SIZE} (the old peak minus the freed tensor)",
        "ds_memory_reset_peak",
    )
    check(
        reset >= acc.memory_allocated() - SIZE // 4,
        "max_memory_allocated() after reset",
        reset,
        "≈ current usage",
        "ds_memory_reset_peak",
    )


@hooks("ds_memory_reserved", "ds_memory_stats")
def test_reserved_and_stats_cover_live_tensors(acc: Any) -> None:
    t = _alloc(acc, SIZE)
    reserved = acc.memory_reserved()
    stats = acc.memory_stats()
    check(
        reserved >= SIZE,
        "memory_reserved()",
        reserved,
        f"≥ {SIZE} with a live {SIZE}-byte tensor",
        "ds_memory_reserved",
    )
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak"):
        check(
            isinstance(stats.get(key), int),
            f"memory_stats()[{key!r}]",
            stats.get(key),
            "an int",
            "ds_memory_stats",
        )
    check(
        stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] >= SIZE,
        "stats peak ≥ current",
        (stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]),
        f"peak ≥ current ≥ {SIZE}",
        "ds_memory_stats",
    )
    del t


@hooks("ds_memory_info")
def test_total_at_least_available_above_zero(acc: Any) -> None:
    info = acc.memory_info()
    check(
        info.total >= info.available > 0,
        "(total, available)",
        (info.total, info.available),
        "total ≥ available > 0",
        "ds_memory_info",
    )
    if info.limit is not None:
        check(
            info.total <= info.limit and bool(info.limit_source),
            "(total, limit, source)",
            (info.total, info.limit, info.limit_source),
            "total ≤ limit, with a source",
            "ds_memory_info",
        )


@capability("memory_limits")
@hooks("ds_memory_info")
def test_values_stay_under_a_process_limit(acc: Any) -> None:
    if acc.device_type != "cpu":
        pytest.skip("the suite can impose a process limit (RLIMIT_AS) only on host memory")
    result = run_python(
        """
        import json, resource
        from ds_core import get_accelerator
        acc = get_accelerator()
        acc.memory_info()
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
        imposed = vm + 512 * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (imposed, hard))
        info = acc.memory_info()
        print(json.dumps({"imposed": imposed, "total": info.total, "available": info.available,
                          "limit": info.limit, "source": info.limit_source}))
        """
    )
    imposed = result["imposed"]
    check(
        result["total"] <= imposed,
        "total under RLIMIT_AS",
        result["total"],
        f"≤ {imposed}",
        "ds_memory_info",
    )
    check(
        0 < result["available"] <= imposed,
        "available under RLIMIT_AS",
        result["available"],
        f"in (0, {imposed}]",
        "ds_memory_info",
    )
    check(
        result["limit"] is not None and result["limit"] <= imposed and bool(result["source"]),
        "(limit, source)",
        (result["limit"], result["source"]),
        f"a limit ≤ {imposed} with its source",
        "ds_memory_info",
    )


@hooks("ds_memory_is_pinned")
def test_ordinary_host_memory_is_not_pinned(acc: Any) -> None:
    t = torch.ones(1024)
    check(
        acc.is_pinned(t) is False,
        "is_pinned(torch.ones(1024))",
        acc.is_pinned(t),
        "False",
        "ds_memory_is_pinned",
    )


@capability("pinned_memory")
@hooks("ds_memory_pin", "ds_memory_is_pinned")
def test_pinning_is_real_and_non_blocking_copies_are_correct(acc: Any) -> None:
    host = torch.arange(1 << 20, dtype=torch.float32)
    pinned = acc.pin_memory(host)
    check(pinned.is_pinned(), "pin_memory(t).is_pinned()", False, "True", "ds_memory_pin")
    check(
        acc.is_pinned(pinned) is True,
        "is_pinned(pin_memory(t))",
        acc.is_pinned(pinned),
        "True",
        "ds_memory_is_pinned",
    )
    on_device = pinned.to(acc.device(), non_blocking=True)
    acc.synchronize()
    check(
        torch.equal(on_device.cpu(), host),
        "non-blocking copy of pinned memory",
        "different",
        "equal to the source",
        "tensor.to(non_blocking=True)",
    )
