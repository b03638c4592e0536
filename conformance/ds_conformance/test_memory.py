"""Memory queries follow real allocations; pinning (capacity and limits: test_memory_limits.py)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from ds_conformance.helpers import MiB, check
from ds_conformance.marks import capability, hooks, promise, tier

pytestmark = tier("basic")

# Large enough to stand out of an allocator's or a resident set's noise, written so the
# pages are really touched (docs/architecture.md §3.5: CPU memory tests use ≥ 64 MiB written
# tensors).
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
@promise("ds_memory_allocated", "Return bytes currently held by live tensors on the device")
@promise("memory", "All sizes are bytes.")
def test_allocated_grows_with_a_tensor_and_falls_when_freed(acc: Any) -> None:
    # The figure is process-wide: another thread of the run releasing memory at the same
    # moment can hide one allocation, so the best of three attempts is judged. A backend that
    # reports a frozen or wrongly scaled figure fails all three.
    attempts = []
    for _ in range(3):
        _free(acc)
        before = acc.memory_allocated()
        t = _alloc(acc, SIZE)
        during = acc.memory_allocated()
        del t
        _free(acc)
        after = acc.memory_allocated()
        attempts.append((during - before, during - after))
        if during - before >= SIZE // 2 and during - after >= SIZE // 2:
            break
    grew = max(g for g, _ in attempts)
    check(
        grew >= SIZE // 2,
        "memory_allocated() growth (bytes)",
        grew,
        f"≥ {SIZE // 2} after allocating {SIZE}",
        "ds_memory_allocated",
    )
    check(
        all(g <= SIZE * 3 // 2 + 16 * MiB for g, _ in attempts),
        "memory_allocated() growth (bytes)",
        max(g for g, _ in attempts),
        f"≤ {SIZE * 3 // 2 + 16 * MiB} after allocating {SIZE} (bytes, not a larger unit)",
        "ds_memory_allocated",
    )
    check(
        max(d for _, d in attempts) >= SIZE // 2,
        "memory_allocated() drop (bytes)",
        max(d for _, d in attempts),
        f"≥ {SIZE // 2} after freeing {SIZE}",
        "ds_memory_allocated + empty_cache",
    )


@hooks("ds_memory_max_allocated", "ds_memory_reset_peak")
@promise("ds_memory_max_allocated", "Return the peak of ``ds_memory_allocated`` since start")
@promise("ds_memory_max_allocated", "Always ≥ the current value.")
@promise(
    "ds_memory_reset_peak",
    "Reset the peak counters so the next peak starts from the current usage.",
)
@promise(
    "ds_memory_reset_peak", ":returns: ``True`` when reset; ``False`` when the platform forbids it"
)
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
@promise("ds_memory_reserved", "Return bytes reserved by the allocator")
@promise("ds_memory_stats", "Return allocator statistics, at least")
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


@hooks("ds_memory_is_pinned")
@promise("ds_memory_is_pinned", "Return whether a host tensor is page-locked")
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
@hooks("ds_memory_pin")
@promise("ds_memory_pin", ":param tensor: a CPU tensor.")
@promise("ds_memory_pin", ":raises ValueError: when ``tensor`` is not on the host.")
def test_pin_refuses_a_tensor_that_is_not_on_the_host(acc: Any) -> None:
    on_device = torch.ones(4, device=acc.device())
    if on_device.device.type == "cpu":
        pytest.skip("the backend's device is the host: every tensor is on it")
    with pytest.raises(ValueError):
        acc._h.ds_memory_pin(on_device)


@hooks("ds_memory_empty_cache", "ds_memory_reserved")
@promise("ds_memory_empty_cache", "Return cached, unused allocator blocks to the device")
def test_empty_cache_returns_the_blocks_of_freed_tensors(acc: Any) -> None:
    # Best of three, as for memory_allocated: another thread may allocate at the same moment.
    drops = []
    for _ in range(3):
        _free(acc)
        t = _alloc(acc, SIZE)
        held = acc.memory_reserved()
        del t
        _free(acc)  # gc, synchronize, empty_cache
        drops.append(held - acc.memory_reserved())
        if drops[-1] >= SIZE // 2:
            break
    check(max(drops) >= SIZE // 2, "memory_reserved() drop (bytes) after freeing a tensor and "
          "empty_cache()", max(drops), f"≥ {SIZE // 2} of the {SIZE} freed",
          "ds_memory_empty_cache")  # fmt: skip


@capability("pinned_memory")
@hooks("ds_memory_pin", "ds_memory_is_pinned")
@promise("ds_memory_pin", "Return a page-locked copy of a host tensor")
@promise("ds_memory_pin", "The result's ``is_pinned()`` is ``True``.")
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


#: (shape, dtype) cases alloc_pinned must honour: a large flat buffer, a 3-d 16-bit one, a
#: scalar and an empty one.
PINNED_CASES: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((1 << 20,), torch.float32),
    ((3, 5, 7), torch.float16),
    ((), torch.int64),
    ((4, 0), torch.uint8),
)


def _pattern(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    return (torch.arange(numel) % 101).to(dtype).reshape(shape)


@capability("pinned_memory")
@hooks("ds_memory_alloc_pinned")
@promise(
    "ds_memory_alloc_pinned", "The result is a contiguous CPU tensor of ``shape`` and ``dtype``"
)
@promise("ds_memory_alloc_pinned", ":param shape: the size of each dimension")
@promise("ds_memory_alloc_pinned", ":param dtype: the element type.")
def test_alloc_pinned_has_the_shape_and_dtype_asked_and_is_writable(acc: Any) -> None:
    for shape, dtype in PINNED_CASES:
        call = f"alloc_pinned({shape}, {dtype})"
        t = acc.alloc_pinned(shape, dtype)
        check(tuple(t.shape) == shape, f"{call}.shape", tuple(t.shape), str(shape), call)
        check(t.dtype == dtype, f"{call}.dtype", t.dtype, str(dtype), call)
        check(t.device.type == "cpu", f"{call}.device", str(t.device), "cpu", call)
        check(t.is_contiguous(), f"{call}.is_contiguous()", False, "True", call)
        want = _pattern(shape, dtype)
        t.copy_(want)
        check(
            torch.equal(t, want), f"{call} after copy_(pattern)", "different", "the pattern", call
        )


@capability("pinned_memory")
@hooks("ds_memory_alloc_pinned", "ds_memory_is_pinned")
@promise("ds_memory_alloc_pinned", "Return a new page-locked host tensor, allocated pinned")
def test_alloc_pinned_is_page_locked_and_non_blocking_copies_are_correct(acc: Any) -> None:
    call = "alloc_pinned((1 << 20,), torch.float32)"
    src = acc.alloc_pinned((1 << 20,), torch.float32)
    check(src.is_pinned(), f"{call}.is_pinned()", False, "True", call)
    check(acc.is_pinned(src) is True, f"is_pinned({call})", acc.is_pinned(src), "True", call)
    want = _pattern((1 << 20,), torch.float32)
    src.copy_(want)
    on_device = src.to(acc.device(), non_blocking=True)
    back = acc.alloc_pinned((1 << 20,), torch.float32)
    back.copy_(on_device, non_blocking=True)
    acc.synchronize()
    check(
        torch.equal(back, want),
        "pinned -> device -> pinned non-blocking round trip",
        "different",
        "equal to the source",
        "tensor.copy_(non_blocking=True)",
    )


def _refused(acc: Any, tensor: torch.Tensor) -> bool:
    try:
        acc.free_pinned(tensor)
    except ValueError:
        return True
    return False


@capability("pinned_memory")
@hooks("ds_memory_free_pinned", "ds_memory_alloc_pinned")
@promise("ds_memory_free_pinned", "Release a tensor ``ds_memory_alloc_pinned`` returned")
@promise("ds_memory_free_pinned", "Its storage is resized to 0 bytes")
@promise("ds_memory_free_pinned", ":returns: ``True``.")
@promise(
    "ds_memory_free_pinned",
    ":raises ValueError: when ``tensor`` is not one of this backend's live pinned allocations",
)
@promise("ds_memory_alloc_pinned", "The backend remembers it as its own until")
@promise("ds_memory_free_pinned", ":param tensor: the very tensor object")
def test_free_pinned_releases_the_storage_and_refuses_any_other_tensor(acc: Any) -> None:
    t = acc.alloc_pinned((1 << 20,), torch.float32)
    t.fill_(1.0)
    freed = acc.free_pinned(t)
    check(freed is True, "free_pinned(t)", freed, "True", "ds_memory_free_pinned")
    nbytes = t.untyped_storage().nbytes()
    check(nbytes == 0, "storage bytes after free_pinned(t)", nbytes, "0", "ds_memory_free_pinned")
    live = acc.alloc_pinned((1 << 10,), torch.float32)
    others = (
        ("an ordinary host tensor", torch.ones(1 << 10)),
        ("a view of a live alloc_pinned buffer", live[1:]),
        ("a tensor already freed", t),
        ("pin_memory(t)'s pinned copy", acc.pin_memory(torch.ones(1 << 10))),
    )
    for what, other in others:
        refused = _refused(acc, other)
        check(
            refused,
            f"free_pinned({what}) raised ValueError",
            refused,
            "True",
            "ds_memory_free_pinned",
        )
    check(
        live.untyped_storage().nbytes() == 4 << 10,
        "storage bytes of a live buffer after refused frees",
        live.untyped_storage().nbytes(),
        str(4 << 10),
        "ds_memory_free_pinned",
    )


@hooks("ds_memory_empty_cache")
@promise("ds_memory_empty_cache", ":returns: ``True``.")
def test_empty_cache_returns_true_every_time(acc: Any) -> None:
    """A value, not merely no error (``None`` or ``False`` is a broken hook), on each call."""
    t = _alloc(acc, SIZE)
    del t
    for n in (1, 2):
        done = acc.empty_cache()
        check(done is True, f"empty_cache() call {n}", done, "True", "ds_memory_empty_cache")


@capability("pinned_memory")
@hooks("ds_memory_alloc_pinned")
@promise("ds_memory_alloc_pinned", ":raises ValueError: when a dimension is negative.")
def test_alloc_pinned_refuses_a_negative_dimension(acc: Any) -> None:
    for shape in ((-1,), (2, -1), (0, -3)):
        with pytest.raises(ValueError):
            acc.alloc_pinned(shape, torch.float32)
