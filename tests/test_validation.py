"""Registration validation: each way a backend can break the hook contract, with its message."""

from __future__ import annotations

import types

import pytest
from ds_backend_cpu import plugin as cpu

from ds_core import hookimpl
from ds_core.errors import BackendValidationError
from ds_core.hookspecs import (
    HOOKSPEC_VERSION,
    MIN_HOOKSPEC_VERSION,
    OPTIONAL_HOOKS,
    all_hook_names,
    required_hook_names,
)
from ds_core.plugins import validate_backend
from ds_core.types import BackendInfo


def clone(**overrides: object) -> types.ModuleType:
    """A module holding every CPU hook, with some replaced or removed (value None)."""
    mod = types.ModuleType("clone")
    for name in all_hook_names():
        if hasattr(cpu, name):
            setattr(mod, name, getattr(cpu, name))
    for name, value in overrides.items():
        if value is None:
            delattr(mod, name)
        else:
            setattr(mod, name, value)
    return mod


def rejection(mod: types.ModuleType, name: str = "cpu") -> str:
    with pytest.raises(BackendValidationError) as info:
        validate_backend(name, mod)
    assert info.value.backend == name
    return str(info.value)


def test_the_cpu_backend_is_valid() -> None:
    info, declared = validate_backend("cpu", cpu)
    assert info.name == "cpu" and info.hookspec_version == HOOKSPEC_VERSION
    assert "memory_limits" in declared


def test_required_and_optional_hooks_partition_the_specs() -> None:
    assert set(required_hook_names()) | set(OPTIONAL_HOOKS) == set(all_hook_names())
    assert set(OPTIONAL_HOOKS) <= set(all_hook_names())


def test_missing_required_hook() -> None:
    msg = rejection(clone(ds_memory_info=None))
    assert "backend 'cpu' was rejected" in msg
    assert "required hook 'ds_memory_info' is missing" in msg
    assert "ds_core.hookspecs.memory" in msg


def test_unknown_hook_suggests_the_close_name() -> None:
    @hookimpl
    def ds_memory_alocated(index: int | None) -> int:
        return 0

    msg = rejection(clone(ds_memory_alocated=ds_memory_alocated))
    assert "'ds_memory_alocated' is not a ds_core hook; did you mean 'ds_memory_allocated'?" in msg


def test_mismatched_argument_names() -> None:
    @hookimpl
    def ds_memory_allocated(device: int | None) -> int:
        return 0

    msg = rejection(clone(ds_memory_allocated=ds_memory_allocated))
    assert "'ds_memory_allocated' takes (device) but the spec takes (index)" in msg


def test_hook_without_the_marker() -> None:
    def ds_device_count() -> int:
        return 1

    msg = rejection(clone(ds_device_count=ds_device_count))
    assert "'ds_device_count' is not marked as a hook: decorate it with @ds_core.hookimpl" in msg


def test_hookspec_version_mismatch_names_both_versions() -> None:
    @hookimpl
    def ds_backend_info() -> BackendInfo:
        return BackendInfo("cpu", "cpu", 0, HOOKSPEC_VERSION + 1)

    msg = rejection(clone(ds_backend_info=ds_backend_info))
    assert (
        f"targets HOOKSPEC_VERSION {HOOKSPEC_VERSION + 1}, but this ds_core has {HOOKSPEC_VERSION}"
        in msg
    )
    info0 = BackendInfo("cpu", "cpu", 0, MIN_HOOKSPEC_VERSION - 1)
    msg = rejection(clone(ds_backend_info=hookimpl(lambda: info0)))
    assert f"targets HOOKSPEC_VERSION {MIN_HOOKSPEC_VERSION - 1}" in msg


def version_1_backend(capabilities: frozenset[str]) -> types.ModuleType:
    """The CPU backend's hooks, as a backend written for hook version 1 would declare them."""

    @hookimpl
    def ds_backend_info() -> BackendInfo:
        return BackendInfo("cpu", "cpu", 0, 1)

    @hookimpl
    def ds_backend_capabilities() -> frozenset[str]:
        return capabilities

    return clone(ds_backend_info=ds_backend_info, ds_backend_capabilities=ds_backend_capabilities)


def test_a_backend_for_an_older_hook_version_registers_without_what_later_versions_added() -> None:
    # docs/architecture.md §2.3: version 1 registers; point-to-point (version 2) is absent
    # for it, and every p2p call refuses naming the capability and the backend.
    import torch

    from ds_core.accelerator import build_accelerator
    from ds_core.errors import NotSupportedError
    from ds_core.plugins import BackendEntry
    from ds_core.types import P2POp

    assert MIN_HOOKSPEC_VERSION == 1 < HOOKSPEC_VERSION
    old = version_1_backend(frozenset({"memory_limits", "determinism"}))
    info, declared = validate_backend("cpu", old)
    assert info.hookspec_version == 1 and "p2p" not in declared
    acc = build_accelerator(BackendEntry("cpu", "ds-core-cpu", "0", "x", plugin=old))
    assert not acc.has("p2p")
    t = torch.zeros(3)
    for call in (
        lambda: acc.send(t, 1),
        lambda: acc.recv(t, 1),
        lambda: acc.batch_isend_irecv([P2POp("send", t, 1)]),
    ):
        with pytest.raises(NotSupportedError, match="p2p") as absent:
            call()
        assert "cpu" in str(absent.value)


def test_a_version_1_backend_may_not_declare_a_version_2_capability() -> None:
    msg = rejection(version_1_backend(frozenset({"p2p"})))
    assert "declares 'p2p', which hook version 2 introduced, but targets version 1" in msg


def test_a_current_backend_without_p2p_hooks_gets_them_from_the_default_plugin() -> None:
    from ds_core.accelerator import build_accelerator
    from ds_core.comm import DefaultCollectives
    from ds_core.plugins import BackendEntry

    # The CPU backend implements them (ds_backend_cpu/shm_p2p.py); a clone without them
    # still declares p2p and is served by the core's default over torch.distributed.
    assert hasattr(cpu, "ds_comm_send")
    own = build_accelerator(BackendEntry("cpu", "ds-core-cpu", "0", "x", plugin=cpu))
    assert own._h.ds_comm_send is cpu.ds_comm_send
    bare = clone(ds_comm_send=None, ds_comm_recv=None, ds_comm_batch_isend_irecv=None)
    acc = build_accelerator(BackendEntry("cpu", "ds-core-cpu", "0", "x", plugin=bare))
    assert acc.has("p2p")
    assert acc.binding()["ds_comm_send"] == "direct"
    assert isinstance(getattr(acc._h.ds_comm_send, "__self__", None), DefaultCollectives)


def test_point_to_point_arguments_are_checked_before_any_communication() -> None:
    import torch

    from ds_core.types import P2POp

    with pytest.raises(ValueError, match=r"P2POp\.op must be 'send' or 'recv', got 'put'"):
        P2POp("put", torch.zeros(1), 1)
    with pytest.raises(ValueError, match=r"P2POp\.peer must be an int, got '1'"):
        P2POp("send", torch.zeros(1), "1")  # type: ignore[arg-type]


def test_entry_point_name_must_match_info_name() -> None:
    msg = rejection(clone(), name="other")
    assert "ds_backend_info().name is 'cpu' but the entry point is named 'other'" in msg


def test_unknown_derived_and_unbacked_capabilities() -> None:
    @hookimpl
    def ds_backend_capabilities() -> frozenset[str]:
        return frozenset({"warp_drive", "bf16", "graph_capture"})

    mod = clone(ds_backend_capabilities=ds_backend_capabilities)
    if hasattr(mod, "ds_graph_create"):
        delattr(mod, "ds_graph_create")
    msg = rejection(mod)
    assert "capability 'warp_drive' is not in the vocabulary" in msg
    assert "capability 'bf16' is derived from ds_dtype_supported" in msg
    assert "declares 'graph_capture' but does not implement 'ds_graph_create'" in msg


def test_all_problems_are_reported_in_one_message() -> None:
    msg = rejection(clone(ds_memory_info=None, ds_device_set=None))
    assert "ds_memory_info" in msg and "ds_device_set" in msg


def test_every_hook_spec_states_its_device_context_and_who_implements_it() -> None:
    from ds_core.hookspecs import SPEC_MODULES

    missing = []
    for module in SPEC_MODULES:
        for name in all_hook_names():
            fn = getattr(module, name, None)
            if fn is None:
                continue
            doc = fn.__doc__ or ""
            for section in ("Device context:", "Use in backends:"):
                if section not in doc:
                    missing.append(f"{name}: {section}")
    assert not missing, missing
