"""Backend identity, probe, capability declaration and second-phase configuration."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import hooks, tier
from ds_core import capabilities as caps
from ds_core.errors import ConfigError
from ds_core.hookspecs import HOOKSPEC_VERSION

pytestmark = tier("basic")


@hooks("ds_backend_info")
def test_info_names_a_usable_torch_device(acc: Any) -> None:
    info = acc.info
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
def test_declared_capabilities_are_in_the_vocabulary(acc: Any) -> None:
    declared = frozenset(acc.entry.plugin.ds_backend_capabilities())
    problems = caps.check_declared(declared)
    check(not problems, "capability problems", problems, "none", "ds_backend_capabilities()")
    for hook, cap in caps.GATED_HOOKS.items():
        if cap in declared:
            check(hasattr(acc.entry.plugin, hook), f"has {hook}", False, "True", f"declares {cap}")


@hooks("ds_backend_configure")
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
    with pytest.raises(ConfigError):
        acc.entry.plugin.ds_backend_configure({"ds_conformance_no_such_option": 1})
