"""Memory edge axes (issue 28 §2): returned statistics are the caller's, a second device is
accounted apart, and the figures stay coherent after a peak reset and after ``empty_cache``."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from ds_conformance import axes
from ds_conformance.helpers import MiB, check
from ds_conformance.marks import hooks, promise, tier

CATEGORY = "memory"
pytestmark = tier("basic")

#: Bytes of the tensors allocated here: above allocator rounding and resident-set noise
#: (docs/architecture.md §3.5: CPU memory tests use ≥ 64 MiB written tensors).
SIZE = 64 * MiB


@pytest.mark.parametrize("hook", axes.state_hooks("memory"))
@promise("hookspecs", axes.STATE_PROMISE)
@hooks(*axes.state_hooks("memory"))
def test_a_returned_state_object_is_the_callers(acc: Any, hook: str) -> None:
    axes.check_state_object(acc, hook, check)


def _settle(acc: Any) -> None:
    gc.collect()
    acc.synchronize()
    acc.empty_cache()


@promise("ds_memory_allocated", "Return bytes currently held by live tensors on the device")
@promise("ds_memory_max_allocated", "Always ≥ the current value.")
@promise("ds_memory_reset_peak", "Reset the peak counters so the next peak starts from")
@hooks("ds_memory_allocated", "ds_memory_max_allocated", "ds_memory_reset_peak")
def test_a_second_device_is_accounted_apart(acc: Any) -> None:
    if acc.device_count() < 2:
        pytest.skip("one device: there is no second device index to account apart")
    first, second = acc.current_device(), (acc.current_device() + 1) % acc.device_count()
    _settle(acc)
    acc.reset_peak_memory_stats(first)
    acc.reset_peak_memory_stats(second)
    before = (acc.memory_allocated(first), acc.memory_allocated(second))
    peak_first = acc.max_memory_allocated(first)
    t = torch.ones(SIZE // 4, device=acc.device(second))
    acc.synchronize(second)
    grew = acc.memory_allocated(second) - before[1]
    moved = acc.memory_allocated(first) - before[0]
    check(
        grew >= SIZE // 2,
        f"memory_allocated({second}) growth",
        grew,
        f"≥ {SIZE // 2} after a {SIZE}-byte tensor on device {second}",
        "ds_memory_allocated",
    )
    check(
        abs(moved) < SIZE // 2,
        f"memory_allocated({first}) change",
        moved,
        f"< {SIZE // 2} (the tensor is on device {second})",
        "ds_memory_allocated",
    )
    check(acc.max_memory_allocated(second) >= acc.memory_allocated(second),
          f"max_memory_allocated({second})", acc.max_memory_allocated(second),
          f"≥ memory_allocated({second})", "ds_memory_max_allocated")  # fmt: skip
    del t
    _settle(acc)
    acc.reset_peak_memory_stats(second)
    after_reset = acc.max_memory_allocated(second)
    check(
        after_reset < before[1] + SIZE // 2,
        f"max_memory_allocated({second}) after its reset",
        after_reset,
        f"< {before[1] + SIZE // 2} (the freed tensor is not the peak any more)",
        "ds_memory_reset_peak",
    )
    check(acc.max_memory_allocated(first) >= peak_first, f"max_memory_allocated({first})",
          acc.max_memory_allocated(first), f"≥ {peak_first} (resetting device {second} "
          f"leaves device {first}'s peak)", "ds_memory_reset_peak")  # fmt: skip


@promise("ds_memory_max_allocated", "Always ≥ the current value.")
@promise("ds_memory_reserved", "Return bytes reserved by the allocator (≥ allocated")
@promise("ds_memory_stats", "Return allocator statistics, at least")
@hooks("ds_memory_empty_cache", "ds_memory_reset_peak", "ds_memory_reserved", "ds_memory_stats")
def test_figures_stay_coherent_after_a_peak_reset_and_empty_cache(acc: Any) -> None:
    keep = torch.arange(SIZE // 4, dtype=torch.float32, device=acc.device())
    _settle(acc)
    for step in ("reset_peak_memory_stats", "empty_cache"):
        getattr(acc, step)()
        allocated, peak = acc.memory_allocated(), acc.max_memory_allocated()
        reserved, stats = acc.memory_reserved(), acc.memory_stats()
        check(
            peak >= allocated,
            f"max_memory_allocated() after {step}()",
            peak,
            f"≥ memory_allocated()={allocated}",
            "ds_memory_max_allocated",
        )
        check(
            reserved >= allocated - SIZE // 4,
            f"memory_reserved() after {step}()",
            reserved,
            f"≥ memory_allocated()={allocated} (within resident-set noise)",
            "ds_memory_reserved",
        )
        keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak")
        check(
            all(isinstance(stats.get(k), int) for k in keys),
            f"memory_stats() after {step}()",
            {k: stats.get(k) for k in keys},
            "ints for both keys",
            "ds_memory_stats",
        )
        check(stats[keys[1]] >= stats[keys[0]], f"memory_stats() peak after {step}()",
              stats[keys[1]], f"≥ current={stats[keys[0]]}", "ds_memory_stats")  # fmt: skip
    # a live tensor is untouched by either, and memory is still handed out afterwards
    diff = axes.first_difference(keep[: 1 << 20], torch.arange(1 << 20, dtype=torch.float32))
    check(diff == "equal", "a live tensor after empty_cache()", diff, "unchanged",
          "ds_memory_empty_cache")  # fmt: skip
    more = torch.ones(SIZE // 4, device=acc.device())
    acc.synchronize()
    check(bool(more[-1].item() == 1.0), "a tensor allocated after empty_cache()",
          more[-1].item(), "1.0", "ds_memory_empty_cache")  # fmt: skip
