"""The hook specifications: the contract between ds_core and a backend.

One module per hook category. Each hook is ``ds_<category>_<verb>``; its docstring is the
contract (arguments and units, return, errors, whether it may create a device context).

Rules shared by every hook:

- Arguments are positional, without defaults, in the order the spec lists them; an
  implementation's signature equals the spec's (same names, same order), so the accelerator
  facade can bind it directly. ``index`` is a device index, ``None`` meaning the current device.
- Integer arguments are checked before the hook acts, by one rule per kind (since version 3).
  An ``index`` typed ``int | None`` is ``None`` (the current device) or an ``int`` in
  ``range(ds_device_count())``. A ``seed`` is an ``int`` in ``range(2**64)``. A stream
  ``priority`` is any ``int``; the device maps one outside its range to the nearest it has.
  An ``int`` out of range raises ``ValueError`` naming the range; an argument of another type
  (a ``bool``, a ``float``, a string, ``None`` where the type has no ``None``) raises
  ``TypeError``.
- Query hooks are ``firstresult``: the first non-``None`` result wins, and a backend never
  returns ``None`` in place of real work. What a backend cannot do, it declares absent through
  ``ds_backend_capabilities``; the facade then raises :class:`ds_core.NotSupportedError`.
- Hooks that gather contributions (``ds_op_providers``, ``ds_launcher_env_prefixes``) are called
  on every plugin and their results concatenated.
- Only ``ds_backend_*`` hooks are called before selection, and they must not create a device
  context, allocate device memory or import a vendor stack that is not installed.
- An object a query hook returns (a statistics dict, a ``MemoryInfo``, a ``DeviceProperties``,
  an RNG state) is the caller's: later calls and device work do not change it, and changing
  it changes nothing in the backend.
"""

from __future__ import annotations

from types import ModuleType
from typing import Final

from ds_core.hookspecs import (
    backend,
    comm,
    determinism,
    device,
    dtype,
    graph,
    launcher,
    memory,
    op,
    profiler,
    rng,
    stream,
)
from ds_core.hookspecs._markers import hookimpl, hookspec

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "The hook specifications: the contract between ds_core and a backend.": "promises nothing: a summary of the section; its sentences below carry the promises",
    "One module per hook category.": "promises nothing: how the spec is laid out",
    "Each hook is ``ds_<category>_<verb>``": "promises nothing: the naming scheme of the spec itself",
    "Rules shared by every hook:": "promises nothing: a heading; the bullets under it carry the promises",
    "Integer arguments are checked before the hook acts, by one rule per kind": "promises nothing: introduces the rules of the sentences after it, each checked",
    "Hooks that gather contributions": "promises nothing: how ds_core calls those hooks (pluggy's non-firstresult call), which is ds_core's behaviour, not the backend's",
    "What a backend cannot do, it declares absent": "promises nothing: the facade's behaviour (ds_core's code; tests/test_facade.py checks the NotSupportedError), while the backend's side, a declared capability backed by its hooks, is its own checked sentence of ds_backend_capabilities",
}


#: The contract's version: bumped when a hook is added, renamed, or changes its arguments or
#: meaning. Version 2 added point-to-point (``ds_comm_send``, ``ds_comm_recv``,
#: ``ds_comm_batch_isend_irecv``, capability ``p2p``). Version 3 states the range rules of
#: integer arguments (device index, seed, stream priority): the errors they raise.
HOOKSPEC_VERSION: Final[int] = 3

#: The oldest version a backend may target and still register: what later versions added is
#: absent for it (docs/architecture.md §2.3).
MIN_HOOKSPEC_VERSION: Final[int] = 1

#: Every hook spec module, in the order reports and docs list them.
SPEC_MODULES: Final[tuple[ModuleType, ...]] = (
    backend,
    device,
    rng,
    stream,
    memory,
    dtype,
    graph,
    comm,
    op,
    determinism,
    launcher,
    profiler,
)

#: Hooks a backend may leave unimplemented, and why it may.
OPTIONAL_HOOKS: Final[dict[str, str]] = {
    "ds_graph_create": "required only when the backend declares 'graph_capture'",
    "ds_memory_pin": "required only when the backend declares 'pinned_memory'",
    "ds_memory_alloc_pinned": "required only when the backend declares 'pinned_memory'",
    "ds_memory_free_pinned": "required only when the backend declares 'pinned_memory'",
    "ds_comm_all_reduce": "the core's default plugin implements it over torch.distributed",
    "ds_comm_all_gather": "the core's default plugin implements it over torch.distributed",
    "ds_comm_reduce_scatter": "the core's default plugin implements it over torch.distributed",
    "ds_comm_broadcast": "the core's default plugin implements it over torch.distributed",
    "ds_comm_all_to_all": "the core's default plugin implements it over torch.distributed",
    "ds_comm_barrier": "the core's default plugin implements it over torch.distributed",
    "ds_comm_send": "the core's default plugin implements it; reached only with 'p2p'",
    "ds_comm_recv": "the core's default plugin implements it; reached only with 'p2p'",
    "ds_comm_batch_isend_irecv": "the core's default plugin implements it; reached only with 'p2p'",
    "ds_op_providers": "a backend without ops contributes none",
    "ds_launcher_env_prefixes": "a backend with nothing to forward contributes none",
    "ds_profiler_range_push": "the core's default plugin opens a torch.profiler range",
    "ds_profiler_range_pop": "the core's default plugin closes a torch.profiler range",
}


def all_hook_names() -> list[str]:
    """Names of every hook spec, in spec-module order."""
    return [
        name
        for module in SPEC_MODULES
        for name in vars(module)
        if name.startswith("ds_") and callable(getattr(module, name))
    ]


def required_hook_names() -> list[str]:
    """Hooks every backend must implement (all hooks not in :data:`OPTIONAL_HOOKS`)."""
    return [n for n in all_hook_names() if n not in OPTIONAL_HOOKS]


__all__ = [
    "HOOKSPEC_VERSION",
    "MIN_HOOKSPEC_VERSION",
    "OPTIONAL_HOOKS",
    "SPEC_MODULES",
    "all_hook_names",
    "hookimpl",
    "hookspec",
    "required_hook_names",
]
