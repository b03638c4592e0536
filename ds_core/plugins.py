"""Backend discovery, validation and selection.

Backends are found through the ``ds_core.backends`` entry point group. Discovery imports each
backend's plugin module (which must not import its vendor stack) and calls its probe directly,
without registering it. Selection registers exactly one backend in the runtime plugin manager,
next to the core's default plugin and any add-on plugins.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import inspect
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from ds_core import capabilities as caps
from ds_core.errors import BackendSelectionError, BackendValidationError
from ds_core.hookspecs import (
    HOOKSPEC_VERSION,
    MIN_HOOKSPEC_VERSION,
    SPEC_MODULES,
    all_hook_names,
    required_hook_names,
)
from ds_core.hookspecs._markers import PROJECT
from ds_core.known_backends import KNOWN_BACKENDS, install_hint
from ds_core.types import BackendInfo, ProbeResult

BACKEND_GROUP = "ds_core.backends"
PLUGIN_GROUP = "ds_core.plugins"
ENV_ACCELERATOR = "DS_ACCELERATOR"
ENV_NO_PLUGIN_AUTOLOAD = "DS_CORE_DISABLE_PLUGIN_AUTOLOAD"

_IMPL_ATTR = PROJECT + "_impl"


@dataclass
class BackendEntry:
    """One installed backend: where it came from, its plugin object, or why it failed to load."""

    name: str
    distribution: str
    version: str
    target: str
    plugin: Any = None
    load_error: str = ""
    _probe: ProbeResult | None = field(default=None, repr=False)

    @property
    def loaded(self) -> bool:
        return self.plugin is not None

    def info(self) -> BackendInfo:
        """Call the backend's ``ds_backend_info`` directly (the backend is not registered)."""
        result: BackendInfo = _impl(self.plugin, "ds_backend_info")()
        return result

    def probe(self) -> ProbeResult:
        """The backend's probe result, computed once per process.

        A probe that raises is an unavailable result carrying the exception; ``KeyboardInterrupt``
        propagates.
        """
        if self._probe is None:
            if not self.loaded:
                self._probe = ProbeResult(False, f"failed to load: {self.load_error}")
            else:
                try:
                    self._probe = _impl(self.plugin, "ds_backend_probe")()
                except Exception as exc:  # a broken probe must not break selection of others
                    self._probe = ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
        return self._probe

    def describe(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


def _impl(plugin: Any, hook: str) -> Callable[..., Any]:
    fn = getattr(plugin, hook, None)
    if fn is None:
        raise BackendValidationError(
            getattr(plugin, "__name__", repr(plugin)), [f"missing required hook '{hook}'"]
        )
    return fn  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- discovery

_lock = threading.RLock()
_entries: dict[str, BackendEntry] | None = None


def discover(refresh: bool = False) -> dict[str, BackendEntry]:
    """Load every backend entry point and return them by name (sorted).

    A backend whose entry point fails to import is kept with ``load_error`` set, so reports can
    name it; it does not stop the others from loading. The result is cached per process.

    :param refresh: ignore the cache and look at installed distributions again.
    :raises BackendSelectionError: when two distributions register the same backend name.
    """
    global _entries
    with _lock:
        if _entries is not None and not refresh:
            return _entries
        found: dict[str, BackendEntry] = {}
        for ep in md.entry_points(group=BACKEND_GROUP):
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown distribution>"
            version = dist.version if dist is not None else "?"
            previous = found.get(ep.name)
            if previous is not None:
                if previous.distribution == dist_name and previous.target == ep.value:
                    continue  # the same distribution seen twice on sys.path
                raise BackendSelectionError(
                    f"two installed distributions both provide the backend '{ep.name}': "
                    f"{previous.distribution} {previous.version} ({previous.target}) and "
                    f"{dist_name} {version} ({ep.value}). Uninstall one of them."
                )
            entry = BackendEntry(ep.name, dist_name, version, ep.value)
            try:
                entry.plugin = ep.load()
            except Exception as exc:
                entry.load_error = f"{type(exc).__name__}: {exc}"
            found[ep.name] = entry
        _entries = dict(sorted(found.items()))
        return _entries


def load_addon_plugins() -> list[Any]:
    """Load add-on plugins from the ``ds_core.plugins`` entry point group.

    Set ``DS_CORE_DISABLE_PLUGIN_AUTOLOAD=1`` to skip them. A failing add-on raises: an add-on
    is something the user installed to change behaviour, and running without it silently
    would change results.
    """
    if os.environ.get(ENV_NO_PLUGIN_AUTOLOAD):
        return []
    plugins = []
    for ep in md.entry_points(group=PLUGIN_GROUP):
        try:
            plugins.append(ep.load())
        except Exception as exc:
            raise BackendSelectionError(
                f"add-on plugin '{ep.name}' ({ep.value}) failed to load: "
                f"{type(exc).__name__}: {exc}. Uninstall it or set "
                f"{ENV_NO_PLUGIN_AUTOLOAD}=1."
            ) from exc
    return plugins


# --------------------------------------------------------------------------- validation

_SPEC_ARGS: dict[str, tuple[str, ...]] = {}


def spec_argnames(hook: str) -> tuple[str, ...]:
    """Argument names of a hook spec, in order."""
    if not _SPEC_ARGS:
        for module in SPEC_MODULES:
            for name, fn in vars(module).items():
                if name.startswith("ds_") and callable(fn):
                    _SPEC_ARGS[name] = tuple(inspect.signature(fn).parameters)
    return _SPEC_ARGS[hook]


def _impl_argnames(fn: Callable[..., Any]) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.name != "self")


def validate_backend(name: str, plugin: Any) -> tuple[BackendInfo, frozenset[str]]:
    """Check a backend plugin against the hook specs; return its info and declared capabilities.

    Every problem is collected and reported in one :class:`BackendValidationError` that names
    the backend, each hook and the fix: a required hook missing, a ``ds_*`` attribute that is
    not a hook, a hook not marked ``@ds_core.hookimpl``, argument names that differ from the
    spec, a hook version mismatch, an unknown capability, or a capability without its hooks.
    """
    known = set(all_hook_names())
    problems: list[str] = []
    implemented: set[str] = set()
    for attr in dir(plugin):
        if not attr.startswith("ds_"):
            continue
        fn = getattr(plugin, attr)
        if not callable(fn):
            continue
        if attr not in known:
            close = difflib.get_close_matches(attr, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(
                f"'{attr}' is not a ds_core hook{hint} Rename it, or make it private (_{attr})."
            )
            continue
        if getattr(fn, _IMPL_ATTR, None) is None:
            problems.append(f"'{attr}' is not marked as a hook: decorate it with @ds_core.hookimpl")
            continue
        implemented.add(attr)
        expected = spec_argnames(attr)
        got = _impl_argnames(fn)
        if got != expected:
            problems.append(
                f"'{attr}' takes ({', '.join(got)}) but the spec takes ({', '.join(expected)}); "
                f"use exactly the spec's argument names and order"
            )
    for hook in required_hook_names():
        if hook not in implemented:
            module = next(m.__name__ for m in SPEC_MODULES if hasattr(m, hook))
            problems.append(
                f"required hook '{hook}' is missing; implement it (contract in {module})"
            )
    info: BackendInfo | None = None
    declared: frozenset[str] = frozenset()
    if "ds_backend_info" in implemented:
        info = plugin.ds_backend_info()
        if not MIN_HOOKSPEC_VERSION <= info.hookspec_version <= HOOKSPEC_VERSION:
            problems.append(
                f"targets HOOKSPEC_VERSION {info.hookspec_version}, but this ds_core has "
                f"{HOOKSPEC_VERSION} (and registers backends built for {MIN_HOOKSPEC_VERSION} "
                f"to {HOOKSPEC_VERSION}); install a backend release built for hook version "
                f"{HOOKSPEC_VERSION}, or a ds-core that provides version {info.hookspec_version}"
            )
        if info.name != name:
            problems.append(
                f"ds_backend_info().name is '{info.name}' but the entry point is named "
                f"'{name}'; make them equal"
            )
    if "ds_backend_capabilities" in implemented:
        declared = frozenset(plugin.ds_backend_capabilities())
        problems.extend(caps.check_declared(declared))
        if info is not None:
            for cap in sorted(declared):
                since = caps.SINCE_VERSION.get(cap, MIN_HOOKSPEC_VERSION)
                if since > info.hookspec_version:
                    problems.append(
                        f"declares '{cap}', which hook version {since} introduced, but targets "
                        f"version {info.hookspec_version}; target version {since} or later"
                    )
        for hook, cap in caps.GATED_HOOKS.items():
            if cap in declared and hook not in implemented:
                problems.append(f"declares '{cap}' but does not implement '{hook}'")
    if problems:
        raise BackendValidationError(name, problems)
    if info is None:  # pragma: no cover - implied by the problems above
        raise BackendValidationError(name, ["ds_backend_info is missing"])
    return info, declared


# --------------------------------------------------------------------------- selection


def _unknown_backend_message(name: str, entries: dict[str, BackendEntry]) -> str:
    installed = ", ".join(entries) or "none"
    folded = [n for n in (*entries, *KNOWN_BACKENDS) if n.lower() == name.lower()]
    hint = install_hint(name)
    if folded:
        # Backend names are case-sensitive (entry-point names); a wrong case is the likeliest typo.
        how = f"Backend names are lower-case: did you mean '{folded[0]}'?"
        if folded[0] not in entries and install_hint(folded[0]):
            how += f" Install it with: {install_hint(folded[0])}"
    elif hint:
        how = f"Install it with: {hint}"
    else:
        close = difflib.get_close_matches(name, list(KNOWN_BACKENDS) + list(entries), n=1)
        known = ", ".join(KNOWN_BACKENDS)
        how = (f"Did you mean '{close[0]}'? " if close else "") + f"Known backends: {known}."
    return f"backend '{name}' is not installed (installed backends: {installed}). {how}"


def choose(requested: str | None, entries: dict[str, BackendEntry]) -> BackendEntry:
    """Pick the backend to use (the rules: README.md, "How a backend is selected") and return its entry.

    :param requested: an explicit name (``DS_ACCELERATOR`` or ``set_accelerator``), or ``None``.
    :raises BackendSelectionError: when the explicit choice is unknown, broken or unavailable;
        when no backend is available; when two available backends tie for priority; and when
        cpu would win while a non-CPU backend is installed but unavailable.
    """
    if requested is not None:
        entry = entries.get(requested)
        if entry is None:
            raise BackendSelectionError(_unknown_backend_message(requested, entries))
        if not entry.loaded:
            raise BackendSelectionError(
                f"backend {entry.describe()} failed to import: {entry.load_error}"
            )
        probe = entry.probe()
        if not probe.available:
            raise BackendSelectionError(
                f"backend '{requested}' was asked for but is not available here: {probe.reason}"
            )
        return entry

    if not entries:
        raise BackendSelectionError(
            "no ds_core backend is installed. Install one, e.g. "
            + install_hint("cpu")
            + " (or the extra for your accelerator: cuda, rocm, xpu, hpu, npu, kunlunxin)."
        )
    usable: list[tuple[BackendEntry, BackendInfo]] = []
    unusable: list[BackendEntry] = []
    for entry in entries.values():
        if entry.loaded and entry.probe().available:
            usable.append((entry, entry.info()))
        else:
            unusable.append(entry)
    if not usable:
        raise BackendSelectionError("no installed backend is available:\n" + _reasons(unusable))
    top = max(info.priority for _, info in usable)
    winners = [(e, i) for e, i in usable if i.priority == top]
    if len(winners) > 1:
        names = " and ".join(e.describe() for e, _ in winners)
        raise BackendSelectionError(
            f"{names} are both available with priority {top}; choose one with "
            f"{ENV_ACCELERATOR}=<name> or ds_core.set_accelerator(name)"
        )
    entry, info = winners[0]
    if info.device_type == "cpu" and unusable:
        raise BackendSelectionError(
            "only the CPU backend is available, but these accelerator backends are installed "
            "and unavailable:\n"
            + _reasons(unusable)
            + f"\nFix the accelerator, or run on the CPU on purpose with {ENV_ACCELERATOR}=cpu."
        )
    return entry


def _reasons(entries: Iterable[BackendEntry]) -> str:
    return "\n".join(f"  - {e.describe()}: {e.probe().reason}" for e in entries)


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager with every hook spec added and nothing registered."""
    pm = pluggy.PluginManager(PROJECT)
    for module in SPEC_MODULES:
        pm.add_hookspecs(module)
    return pm
