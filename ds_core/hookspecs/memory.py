"""Memory queries, the caching allocator, and pinned host memory. All sizes are bytes."""

from __future__ import annotations

from typing import Final

import torch

from ds_core.hookspecs._contract import FACADE, MAY_CREATE_CONTEXT, OPTIONAL, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import MemoryInfo

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Memory queries, the caching allocator, and pinned host memory.": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_allocated(index: int | None) -> int:
    """Return bytes currently held by live tensors on the device (cpu: the process's resident set).

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``memory_allocated(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_max_allocated(index: int | None) -> int:
    """Return the peak of ``ds_memory_allocated`` since start or the last ``ds_memory_reset_peak``.

    Always ≥ the current value.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``max_memory_allocated(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_reset_peak(index: int | None) -> bool:
    """Reset the peak counters so the next peak starts from the current usage.

    :param index: device index, or ``None`` for the current device.
    :returns: ``True`` when reset; ``False`` when the platform forbids it (the peak then keeps
        its old value, and reports say so).

    Device context: may create one.

    Use in backends: required. Facade: ``reset_peak_memory_stats(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_reserved(index: int | None) -> int:
    """Return bytes reserved by the allocator (≥ allocated; equal where there is no cache).

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``memory_reserved(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_stats(index: int | None) -> dict[str, int]:
    """Return allocator statistics, at least ``allocated_bytes.all.current`` and ``.peak``.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``memory_stats(index=None)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
def ds_memory_empty_cache() -> bool:
    """Return cached, unused allocator blocks to the device (or the OS).

    :returns: ``True``.

    Device context: never creates one; a no-op on a device that has none yet.

    Use in backends: required. Facade: ``empty_cache()``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_info(index: int | None) -> MemoryInfo:
    """Return total and available device memory for this process, capped by its own limits.

    ``total`` is never the host's or device's capacity when a lower per-process limit applies
    (rlimit, cgroup, a vendor memory fraction); ``limit`` and ``limit_source`` name it.
    ``total ≥ available > 0`` on a usable device. ``available`` is 0, never negative, once a
    limit's usage reaches it.

    :param index: device index, or ``None`` for the current device.

    Device context: may create one.

    Use in backends: required. Facade: ``total_memory()``, ``available_memory()``, ``memory_info()``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked(
    "To get a pinned buffer without a pageable one first",
    "promises nothing: a pointer to another hook",
)
def ds_memory_pin(tensor: torch.Tensor) -> torch.Tensor:
    """Return a page-locked copy of a host tensor, so device copies can be non-blocking.

    The result's ``is_pinned()`` is ``True``. Gated by the ``pinned_memory`` capability. To get
    a pinned buffer without a pageable one first, use ``ds_memory_alloc_pinned``.

    :param tensor: a CPU tensor.
    :raises ValueError: when ``tensor`` is not on the host.

    Device context: may create one.

    Use in backends: optional (required with ``pinned_memory``). Facade: ``pin_memory(t)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return a new page-locked host tensor, allocated pinned (no pageable buffer, no copy).

    The result is a contiguous CPU tensor of ``shape`` and ``dtype`` whose ``is_pinned()`` and
    ``ds_memory_is_pinned`` are ``True``; its contents are unspecified (as ``torch.empty``'s):
    write it before reading it. The backend remembers it as its own until
    ``ds_memory_free_pinned`` releases it. Gated by the ``pinned_memory`` capability.

    :param shape: the size of each dimension, in elements (``()`` for a scalar, ``0`` allowed).
    :param dtype: the element type.
    :raises ValueError: when a dimension is negative.

    Device context: may create one.

    Use in backends: optional (required with ``pinned_memory``). Facade:
    ``alloc_pinned(shape, dtype)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_memory_free_pinned(tensor: torch.Tensor) -> bool:
    """Release a tensor ``ds_memory_alloc_pinned`` returned, now rather than at garbage collection.

    Its storage is resized to 0 bytes, so the page-locked block goes back to the vendor's
    pinned-host allocator (which may keep it cached for the next pinned allocation) even while
    references to the tensor remain; afterwards ``tensor.untyped_storage().nbytes() == 0``, the
    tensor (and every view of it) holds no memory and must not be read or written.

    :param tensor: the very tensor object ``ds_memory_alloc_pinned`` returned (not a view).
    :returns: ``True``.
    :raises ValueError: when ``tensor`` is not one of this backend's live pinned allocations
        (an ordinary or ``ds_memory_pin`` tensor, a view, or one already freed).

    Device context: may create one.

    Use in backends: optional (required with ``pinned_memory``). Facade: ``free_pinned(t)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
def ds_memory_is_pinned(tensor: torch.Tensor) -> bool:
    """Return whether a host tensor is page-locked for this device type.

    Device context: never.

    Use in backends: required. Facade: ``is_pinned(t)``.
    """
