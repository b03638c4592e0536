"""Backend identity, probe, capability declaration and second-phase configuration."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from ds_conformance import axes
from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier
from ds_core import capabilities as caps
from ds_core.errors import ConfigError, NotSupportedError
from ds_core.hookspecs import HOOKSPEC_VERSION
from ds_core.types import BackendInfo

pytestmark = tier("basic")


@hooks("ds_backend_info")
@promise("ds_backend_info", "``name`` must equal the backend's entry point name")
@promise("ds_backend_info", "Return the backend's identity: name, torch device type")
@promise("ds_backend_info", ":returns: a :class:`ds_core.types.BackendInfo`.")
def test_info_names_a_usable_torch_device(acc: Any) -> None:
    info = acc.info
    raw = acc.entry.plugin.ds_backend_info()
    check(
        isinstance(raw, BackendInfo), "type", type(raw).__name__, "BackendInfo", "ds_backend_info()"
    )
    check(
        info.name == acc.entry.name,
        "info.name",
        info.name,
        f"{acc.entry.name!r}",
        "ds_backend_info()",
    )
    check(
        info.hookspec_version == HOOKSPEC_VERSION,
        "info.hookspec_version",
        info.hookspec_version,
        str(HOOKSPEC_VERSION),
        "ds_backend_info()",
    )
    device = torch.device(info.device_type)
    check(
        device.type == info.device_type,
        "torch.device(type).type",
        device.type,
        info.device_type,
        "torch.device",
    )


@hooks("ds_backend_probe", "ds_device_count")
@promise("ds_backend_probe", "Report whether this backend can run on this host")
def test_probe_reports_the_devices_it_found(acc: Any) -> None:
    probe = acc.probe()
    check(probe.available, "probe.available", probe.available, "True", "ds_backend_probe()")
    check(
        bool(probe.reason),
        "probe.reason",
        probe.reason,
        "a non-empty explanation",
        "ds_backend_probe()",
    )
    check(
        probe.device_count == acc.device_count(),
        "probe.device_count",
        probe.device_count,
        f"ds_device_count()={acc.device_count()}",
        "ds_backend_probe()",
    )


@hooks("ds_backend_capabilities")
@promise(
    "ds_backend_capabilities",
    "Return the capabilities this backend declares, from :mod:`ds_core.capabilities`.",
)
@promise(
    "ds_backend_capabilities",
    "Dtype capabilities are derived from ``ds_dtype_supported`` and must not be listed.",
)
@promise("ds_backend_capabilities", "A declared capability must be backed by its gated hooks")
@promise("ds_memory_pin", "Gated by the ``pinned_memory`` capability.")
@promise("ds_memory_alloc_pinned", "Gated by the ``pinned_memory`` capability.")
@promise("ds_backend_capabilities", ":returns: a frozenset of capability names.")
def test_declared_capabilities_are_in_the_vocabulary(acc: Any) -> None:
    raw = acc.entry.plugin.ds_backend_capabilities()
    check(
        isinstance(raw, frozenset) and all(isinstance(c, str) for c in raw),
        "ds_backend_capabilities()",
        raw,
        "a frozenset of capability names",
        "ds_backend_capabilities()",
    )
    declared = frozenset(raw)
    problems = caps.check_declared(declared)
    check(not problems, "capability problems", problems, "none", "ds_backend_capabilities()")
    for hook, cap in caps.GATED_HOOKS.items():
        if cap in declared:
            check(hasattr(acc.entry.plugin, hook), f"has {hook}", False, "True", f"declares {cap}")


@hooks("ds_backend_configure")
@promise("ds_backend_configure", "The call is idempotent.")
@promise("ds_backend_configure", ":returns: ``True`` once applied.")
@promise("ds_backend_configure", ":param options: the backend's options; may be empty.")
@promise("ds_backend_configure", "Use in backends: required (accept an empty mapping).")
@promise("ds_backend_configure", "Unknown keys raise ``ds_core.ConfigError`` naming the key.")
@promise("ds_backend_configure", ":raises ds_core.ConfigError: on an unknown key or invalid value.")
def test_configure_is_idempotent_and_rejects_unknown_keys(acc: Any) -> None:
    first = acc.entry.plugin.ds_backend_configure({})
    second = acc.entry.plugin.ds_backend_configure({})
    check(
        first is True and second is True,
        "configure({}) twice",
        (first, second),
        "(True, True)",
        "ds_backend_configure({})",
    )
    with pytest.raises(ConfigError, match="ds_conformance_no_such_option"):
        acc.entry.plugin.ds_backend_configure({"ds_conformance_no_such_option": 1})


def _spec_functions() -> dict[str, Any]:
    from ds_core.hookspecs import SPEC_MODULES, all_hook_names

    names = set(all_hook_names())
    return {n: getattr(m, n) for m in SPEC_MODULES for n in vars(m) if n in names}


def _required_by_their_docstrings() -> list[str]:
    """Hooks whose docstring says "Use in backends: required" (each linked below)."""
    from ds_conformance.coverage import sentences

    return [
        name
        for name, fn in _spec_functions().items()
        if any(s.startswith("Use in backends: required") for s in sentences(fn.__doc__))
    ]


@hooks("ds_backend_info")
def test_the_backend_implements_every_required_hook_with_the_spec_signature(acc: Any) -> None:
    """Every hook its spec calls required is implemented by the backend's plugin, and every
    hook it implements takes the spec's arguments, by the same names in the same order."""
    import inspect

    plugin = acc.entry.plugin
    missing = [h for h in _required_by_their_docstrings() if not callable(getattr(plugin, h, None))]
    check(not missing, "required hooks not implemented", missing, "none", "the backend's plugin")
    for name, spec in _spec_functions().items():
        impl = getattr(plugin, name, None)
        if impl is None:
            continue
        want = [(p.name, p.kind) for p in inspect.signature(spec).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(impl).parameters.values()]
        check(
            got == want,
            f"{name} arguments",
            [n for n, _ in got],
            f"{[n for n, _ in want]} (positional, as the spec)",
            "the backend's plugin",
        )


for _hook in _required_by_their_docstrings():
    test_the_backend_implements_every_required_hook_with_the_spec_signature = promise(
        _hook, "Use in backends: required"
    )(test_the_backend_implements_every_required_hook_with_the_spec_signature)
test_the_backend_implements_every_required_hook_with_the_spec_signature = promise(
    "hookspecs", "an implementation's signature equals the spec's"
)(test_the_backend_implements_every_required_hook_with_the_spec_signature)


#: Query hooks called with no argument or ``index=None`` by the check below, except those whose
#: call needs a state first (a pop needs a push; a graph needs capture enabled).
NEEDS_STATE: frozenset[str] = frozenset({"ds_profiler_range_pop", "ds_graph_create"})
QUERY_HOOKS: list[str] = [
    name
    for name, fn in axes.spec_hooks().items()
    if getattr(fn, "ds_core_spec", {}).get("firstresult")
    and [str(p.annotation) for p in inspect.signature(fn).parameters.values()]
    in ([], ["int | None"])
    and name not in NEEDS_STATE
]


@pytest.mark.parametrize("hook", QUERY_HOOKS)
@promise("hookspecs", "a backend never returns ``None`` in place of real work")
@hooks(*QUERY_HOOKS)
def test_a_query_hook_returns_a_result_not_none(acc: Any, hook: str) -> None:
    args = [None] * len(inspect.signature(axes.spec_hooks()[hook]).parameters)
    try:
        result = getattr(acc._h, hook)(*args)
    except NotSupportedError:
        pytest.skip(f"{hook} is gated by a capability the backend does not declare")
    check(result is not None, f"{hook}({', '.join(map(repr, args))})", None, "a result", hook)


@hooks("ds_backend_info")
@promise("ds_backend_info", ":raises: nothing; must be cheap and pure.")
def test_info_is_pure(acc: Any) -> None:
    plugin = acc.entry.plugin
    first = plugin.ds_backend_info()
    for n in range(2):
        again = plugin.ds_backend_info()
        check(again == first, f"ds_backend_info() call {n + 2}", again, f"{first} (the first "
              "call's: pure)", "ds_backend_info")  # fmt: skip
