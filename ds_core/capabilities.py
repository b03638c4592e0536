"""The closed vocabulary of capabilities a backend may declare.

A capability gates a hook group or a behaviour. Callers gate on capabilities, never on a
backend's name. A backend declares what it has through ``ds_backend_capabilities``; dtype
capabilities (``fp16``, ``bf16``, ``fp64``, ``fp8``) are derived from ``ds_dtype_supported``
and must not be declared by hand.
"""

from __future__ import annotations

from typing import Final

#: capability name -> (hook group it gates, meaning)
CAPABILITIES: Final[dict[str, tuple[str, str]]] = {
    "async_streams": (
        "stream",
        "streams run concurrently with the host; without it stream hooks are synchronous",
    ),
    "device_timing": (
        "stream",
        "events time work on the device; without it elapsed_time uses host timers",
    ),
    "pinned_memory": (
        "memory",
        "ds_memory_pin and ds_memory_alloc_pinned return page-locked host memory, "
        "ds_memory_free_pinned releases it",
    ),
    "memory_limits": (
        "memory",
        "total/available memory honour the process's own limit (rlimit, cgroup, quota)",
    ),
    "graph_capture": ("graph", "ds_graph_create returns a capturable, replayable graph"),
    "determinism": ("determinism", "ds_determinism_apply makes repeated runs bitwise equal"),
    "p2p": (
        "comm",
        "point-to-point: ds_comm_send, ds_comm_recv and ds_comm_batch_isend_irecv reach a "
        "peer (hook version 2); without it pipeline parallelism is refused",
    ),
    # DeepSpeed's execution-model flags, for asynchronous devices whose runtime does the work
    # itself (Gaudi's graph compiler does both). A synchronous device implies both.
    "resolves_data_dependency": (
        "stream",
        "the runtime orders work across streams itself, so explicit stream waits may be skipped",
    ),
    "handles_memory_backpressure": (
        "memory",
        "the runtime throttles allocation itself, so callers need not synchronise to free memory",
    ),
    "fp16": ("dtype", "derived: torch.float16 is in ds_dtype_supported"),
    "bf16": ("dtype", "derived: torch.bfloat16 is in ds_dtype_supported"),
    "fp64": ("dtype", "derived: torch.float64 is in ds_dtype_supported"),
    "fp8": ("dtype", "derived: a torch.float8 dtype is in ds_dtype_supported"),
}

#: Capabilities derived from the dtype hook; a backend may not declare these itself.
DERIVED: Final[frozenset[str]] = frozenset({"fp16", "bf16", "fp64", "fp8"})

#: Optional hooks and the capability whose declaration requires them.
GATED_HOOKS: Final[dict[str, str]] = {
    "ds_graph_create": "graph_capture",
    "ds_memory_pin": "pinned_memory",
    "ds_memory_alloc_pinned": "pinned_memory",
    "ds_memory_free_pinned": "pinned_memory",
}


#: Hooks the core's default plugin implements over ``torch.distributed`` but that callers
#: reach only when the backend declares the capability (its process-group library may lack
#: them): a backend declaring it may rely on the default or implement its own.
DEFAULTED_GATED_HOOKS: Final[dict[str, str]] = {
    "ds_comm_send": "p2p",
    "ds_comm_recv": "p2p",
    "ds_comm_batch_isend_irecv": "p2p",
}

#: The hook version (``ds_core.HOOKSPEC_VERSION``) that introduced a capability; a backend
#: written for an older version may not declare it (it reports the capability absent).
SINCE_VERSION: Final[dict[str, int]] = {"p2p": 2}


def gate_of(hook: str) -> str | None:
    """The capability a hook is gated by, or ``None``."""
    return GATED_HOOKS.get(hook) or DEFAULTED_GATED_HOOKS.get(hook)


def check_declared(declared: frozenset[str]) -> list[str]:
    """Return one problem string per unknown or derived capability in ``declared``."""
    problems = []
    for cap in sorted(declared):
        if cap not in CAPABILITIES:
            problems.append(
                f"capability '{cap}' is not in the vocabulary; known: {', '.join(sorted(CAPABILITIES))}"
            )
        elif cap in DERIVED:
            problems.append(
                f"capability '{cap}' is derived from ds_dtype_supported; do not declare it"
            )
    return problems
