"""What a launcher needs to start ranks on this device type."""

from __future__ import annotations

from ds_core.hookspecs._markers import hookspec


@hookspec(firstresult=True)
def ds_launcher_visible_devices_env() -> list[str]:
    """Return the variables that restrict which devices a process sees, most specific first.

    A launcher writes the device list to each (``"0,1"``); the count the backend reports then
    follows it. Empty for a device type without such a variable.

    Device context: never.

    Use in backends: required. Facade: ``visible_devices_envs()``, ``set_visible_devices_envs``.
    """


@hookspec
def ds_launcher_env_prefixes() -> list[str]:
    """Return prefixes of environment variables a multi-node launcher forwards to every node.

    Called on every plugin; results are concatenated (e.g. ``["NCCL_", "PYTHON"]``).

    Device context: never.

    Use in backends: optional. Facade: ``export_envs()``.
    """
