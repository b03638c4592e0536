"""The CPU backend's ``ds_memory_info`` over a chosen list of limits; the ``memory_ignores_*``
broken backends pass the process's limits less the ones their bug ignores."""

from ds_backend_cpu import memory

from ds_core.types import MemoryInfo


def memory_info_of(limits: list[memory.Limit]) -> MemoryInfo:
    """Total and available memory capped by ``limits`` alone, as the CPU backend caps them."""
    total, available = memory.host_total(), memory.host_available()
    binding = None
    for lim in limits:
        if lim.limit < total:
            total, binding = lim.limit, lim
        available = min(available, max(lim.limit - lim.used, 0))
    return MemoryInfo(
        total=total,
        available=min(available, total),
        limit=binding.limit if binding else None,
        limit_source=binding.source if binding else "",
    )
