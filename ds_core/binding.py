"""How the facade binds a hook: directly, with DeepSpeed's defaults, through pluggy, or absent.

:class:`ds_core.facade.Accelerator` resolves every hook once (and again when a wrapper plugin
comes or goes). This module holds the tables and the small closures that resolution uses: the
hooks whose facade signature is the spec's (:data:`DIRECT`), those that add DeepSpeed's trailing
defaults (:data:`DEFAULTED`), the router that sends a call through pluggy when a wrapper must see
it, and the stand-in that raises for a capability the backend did not declare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds_core.errors import NotSupportedError
from ds_core.plugins import spec_argnames

#: facade attribute -> hook, for hooks whose facade signature equals the spec's exactly.
DIRECT: dict[str, str] = {
    "current_device": "ds_device_current",
    "device_count": "ds_device_count",
    "set_device": "ds_device_set",
    "stream": "ds_stream_use",
    "is_pinned": "ds_memory_is_pinned",
    "pin_memory": "ds_memory_pin",
    "alloc_pinned": "ds_memory_alloc_pinned",
    "free_pinned": "ds_memory_free_pinned",
    "empty_cache": "ds_memory_empty_cache",
    "communication_backend_name": "ds_comm_backend_name",
    "range_push": "ds_profiler_range_push",
    "range_pop": "ds_profiler_range_pop",
}

#: facade attribute -> (hook, defaults of its trailing arguments), for hooks whose facade
#: signature is the spec's with DeepSpeed's defaults: bound as a one-line closure that fills in
#: the defaults and calls the implementation (one frame more than DIRECT, nothing else).
DEFAULTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "synchronize": ("ds_device_synchronize", (None,)),
    "device_properties": ("ds_device_properties", (None,)),
    "get_rng_state": ("ds_rng_get_state", (None,)),
    "set_rng_state": ("ds_rng_set_state", (None,)),
    "default_generator": ("ds_rng_default_generator", (None,)),
    "Stream": ("ds_stream_create", (None, 0)),
    "Event": ("ds_stream_event_create", (False,)),
    "current_stream": ("ds_stream_current", (None,)),
    "default_stream": ("ds_stream_default", (None,)),
    "memory_allocated": ("ds_memory_allocated", (None,)),
    "max_memory_allocated": ("ds_memory_max_allocated", (None,)),
    "reset_peak_memory_stats": ("ds_memory_reset_peak", (None,)),
    "memory_reserved": ("ds_memory_reserved", (None,)),
    "memory_stats": ("ds_memory_stats", (None,)),
    "memory_info": ("ds_memory_info", (None,)),
}


def with_defaults(
    fn: Callable[..., Any], hook: str, defaults: tuple[Any, ...]
) -> Callable[..., Any]:
    """``fn`` (whose arguments are the spec's, without defaults) with trailing ``defaults``.

    Written out per argument list rather than with ``*args``: a closure with fixed arguments,
    named as the spec names them (callers pass them by keyword too), is the cheapest Python
    call that can fill in a default.
    """
    shape = (spec_argnames(hook), len(defaults))
    if shape == (("index",), 1):
        (d,) = defaults

        def by_index(index: Any = d) -> Any:
            return fn(index)

        return by_index
    if shape == (("enable_timing",), 1):
        (d,) = defaults

        def by_timing(enable_timing: Any = d) -> Any:
            return fn(enable_timing)

        return by_timing
    if shape == (("state", "index"), 1):
        (d,) = defaults

        def by_state(state: Any, index: Any = d) -> Any:
            return fn(state, index)

        return by_state
    if shape == (("index", "priority"), 2):
        d0, d1 = defaults

        def by_priority(index: Any = d0, priority: Any = d1) -> Any:
            return fn(index, priority)

        return by_priority
    raise TypeError(f"no defaults binding for {hook} with arguments {shape}")  # pragma: no cover


def router(caller: Any, argnames: tuple[str, ...]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return caller(**dict(zip(argnames, args, strict=True)))

    call._ds_routed = True  # type: ignore[attr-defined]
    return call


def absent(capability: str, backend: str, hook: str) -> Callable[..., Any]:
    def raise_absent(*args: Any) -> Any:
        raise NotSupportedError(capability, backend, hook)

    return raise_absent
