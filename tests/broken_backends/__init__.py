"""Deliberately broken backends: each reuses the CPU backend and breaks one contract.

Each ``<name>.py`` here is the body of a backend module; :func:`install` writes it, with an
identity and a real ``dist-info`` (via ``tests.distfactory``), into a directory that a
subprocess puts on ``PYTHONPATH``, so ``importlib.metadata`` discovers it like a wheel.
:data:`BROKEN` maps each to the one conformance category that must catch it; CI runs each
only on that category.
"""

from __future__ import annotations

from pathlib import Path

from tests.distfactory import make_backend

HERE = Path(__file__).parent

#: backend file stem -> (category that must fail, a test that must fail there, what is broken)
BROKEN: dict[str, tuple[str, str, str]] = {
    "memory_frozen": (
        "memory",
        "test_allocated_grows_with_a_tensor_and_falls_when_freed",
        "memory_allocated never changes",
    ),
    "event_negative": (
        "stream",
        "test_elapsed_time_is_non_negative_and_monotone",
        "elapsed_time reports negative milliseconds",
    ),
    "reduce_scatter_wrong_shard": (
        "comm",
        "test_reduce_scatter[sum-float32-w2]",
        "reduce-scatter returns the next rank's shard",
    ),
    "probe_touches_device": (
        "hygiene",
        "test_probe_creates_no_device_context",
        "the probe initialises a (fake) vendor runtime it does not declare",
    ),
    "graph_replay_stale": (
        "graph",
        "test_replay_reads_the_new_static_input",
        "graph replay ignores new inputs",
    ),
    "rng_restore_noop": (
        "rng",
        "test_state_save_and_restore_gives_identical_draws",
        "set_rng_state does nothing",
    ),
}

_IDENTITY = """

@hookimpl
def ds_backend_info():
    return BackendInfo(name={name!r}, device_type="cpu", priority=0, hookspec_version=1,
                       description="deliberately broken test backend")
"""


def install(root: Path, stem: str, name: str | None = None) -> str:
    """Write broken backend ``stem`` as an installed distribution in ``root``; return its name.

    The backend's entry point name is ``name`` (default: ``stem`` with ``-`` for ``_``).
    """
    name = name or stem.replace("_", "-")
    source = (HERE / f"{stem}.py").read_text()
    for extra in HERE.glob(f"{stem}__*.py"):  # helper modules the backend imports
        (root / extra.name.split("__", 1)[1]).write_text(extra.read_text())
    make_backend(root, name, module=f"ds_broken_{stem}", body=source + _IDENTITY.format(name=name))
    return name
