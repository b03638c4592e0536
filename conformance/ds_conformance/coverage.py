"""Which hook specs the suite's tests cover (from their ``ds_hooks`` markers)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable

import ds_conformance


def covered_hooks() -> dict[str, list[str]]:
    """Hook name -> ``category/test`` ids of the suite tests that declare it."""
    covered: dict[str, list[str]] = {}
    for info in pkgutil.iter_modules(ds_conformance.__path__):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"ds_conformance.{info.name}")
        category = info.name.removeprefix("test_")
        for name, fn in vars(module).items():
            if not (name.startswith("test_") and callable(fn)):
                continue
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "ds_hooks":
                    for hook in mark.args:
                        covered.setdefault(hook, []).append(f"{category}/{name}")
    return covered


def uncovered(hooks: Iterable[str] | None = None) -> list[str]:
    """Hooks (default: every hook spec of the installed ds_core) that no suite test declares."""
    if hooks is None:
        from ds_core.hookspecs import all_hook_names

        hooks = all_hook_names()
    covered = covered_hooks()
    return [h for h in hooks if h not in covered]


def unknown() -> list[str]:
    """Hook names declared by tests that are not hook specs (typos, removed hooks)."""
    from ds_core.hookspecs import all_hook_names

    known = set(all_hook_names())
    return sorted(h for h in covered_hooks() if h not in known)
