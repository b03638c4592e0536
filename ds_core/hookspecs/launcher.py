"""What a launcher needs to start ranks on this device type."""

from __future__ import annotations

from typing import Final

from ds_core.hookspecs._contract import CALLED_BY_CORE, FACADE, OPTIONAL, unchecked
from ds_core.hookspecs._markers import hookspec

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "What a launcher needs to start ranks on this device type.": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked(
    "Empty for a device type without such a variable.",
    "untestable because whether a device type has a visible-devices variable is the vendor's "
    "fact, which no portable check knows",
)
def ds_launcher_visible_devices_env() -> list[str]:
    """Return the variables that restrict which devices a process sees, most specific first.

    A launcher writes the device list to each (``"0,1"``); the count the backend reports then
    follows it. Empty for a device type without such a variable.

    Device context: never.

    Use in backends: required. Facade: ``visible_devices_envs()``, ``set_visible_devices_envs``.
    """


@hookspec
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Called on every plugin; results are concatenated", CALLED_BY_CORE)
def ds_launcher_env_prefixes() -> list[str]:
    """Return prefixes of environment variables a multi-node launcher forwards to every node.

    Called on every plugin; results are concatenated (e.g. ``["NCCL_", "PYTHON"]``).

    Device context: never.

    Use in backends: optional. Facade: ``export_envs()``.
    """
