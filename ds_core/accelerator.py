"""Which accelerator this process uses: the selection state and the process's one facade.

:func:`get_accelerator` selects a backend on first use (docs/architecture.md §4.2) and returns the
process's :class:`~ds_core.facade.Accelerator` (re-exported here); :func:`set_accelerator`,
:func:`register_plugin` and :func:`reset_accelerator` change what it selects or binds. The
facade itself, with every method a caller uses, is in :mod:`ds_core.facade`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ds_core.binding import DIRECT
from ds_core.default_plugin import DefaultCollectives, DefaultProfiler
from ds_core.errors import DSCoreError
from ds_core.facade import Accelerator
from ds_core.plugins import (
    ENV_ACCELERATOR,
    BackendEntry,
    choose,
    discover,
    load_addon_plugins,
    new_plugin_manager,
    validate_backend,
)

__all__ = [
    "DIRECT",
    "Accelerator",
    "build_accelerator",
    "get_accelerator",
    "register_plugin",
    "reset_accelerator",
    "set_accelerator",
    "unregister_plugin",
]

_state_lock = threading.RLock()
_selected: Accelerator | None = None
_requested: str | None = None
_pending_plugins: list[Any] = []


def get_accelerator() -> Accelerator:
    """Return the process's accelerator, selecting a backend on the first call.

    Selection: ``set_accelerator(name)``, else ``DS_ACCELERATOR``, else the available backend
    of highest priority (docs/architecture.md §3.1, §4.2). The selected backend is validated
    against the hook specs and registered with the core's default plugin and any add-on
    plugins.

    :raises BackendSelectionError: when no backend can be selected (the message says why).
    :raises BackendValidationError: when the selected backend breaks the hook contract.
    """
    global _selected
    if _selected is not None:
        return _selected
    with _state_lock:
        if _selected is None:
            requested = _requested or os.environ.get(ENV_ACCELERATOR) or None
            entries = discover()
            entry = choose(requested, entries)
            _selected = build_accelerator(entry)
        return _selected


def build_accelerator(entry: BackendEntry) -> Accelerator:
    """Validate ``entry`` and build an :class:`Accelerator` for it (no process state changes)."""
    info, declared = validate_backend(entry.name, entry.plugin)
    pm = new_plugin_manager()
    pm.register(DefaultCollectives(), name="ds_core.default")
    pm.register(DefaultProfiler(), name="ds_core.default.profiler")
    pm.register(entry.plugin, name=f"backend:{entry.name}")
    for plugin in load_addon_plugins() + _pending_plugins:
        pm.register(plugin)
    pm.check_pending()
    return Accelerator(pm, entry, info, declared)


def set_accelerator(name: str) -> None:
    """Choose the backend by name before first use (overrides ``DS_ACCELERATOR``).

    :raises DSCoreError: when a different backend is already selected in this process.
    """
    global _requested
    with _state_lock:
        if _selected is not None:
            if _selected.name != name:
                raise DSCoreError(
                    f"backend '{_selected.name}' is already in use in this process; "
                    f"set_accelerator('{name}') must come before the first get_accelerator()"
                )
            return
        _requested = name


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register an add-on plugin (tracer, byte counter, extra op provider).

    Wrapper hooks (``@ds_core.hookimpl(wrapper=True)``) then see every call of the hooks they
    wrap; the facade re-binds at once.
    """
    with _state_lock:
        if _selected is None:
            _pending_plugins.append(plugin)
            return
        _selected._pm.register(plugin, name=name)
        _selected._pm.check_pending()
        _selected.rebind()


def unregister_plugin(plugin: Any) -> None:
    """Remove an add-on plugin registered with :func:`register_plugin`; hooks re-bind direct."""
    with _state_lock:
        if plugin in _pending_plugins:
            _pending_plugins.remove(plugin)
        if _selected is not None:
            _selected._pm.unregister(plugin)
            _selected.rebind()


def reset_accelerator() -> None:
    """Forget the selected backend and explicit choice (tools and tests that switch backends)."""
    global _selected, _requested
    with _state_lock:
        _selected = None
        _requested = None
        _pending_plugins.clear()
