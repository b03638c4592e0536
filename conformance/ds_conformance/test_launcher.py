"""What a launcher needs: visible-devices variables that really restrict the count."""

from __future__ import annotations

from typing import Any

import pytest

from ds_conformance.helpers import check, run_python
from ds_conformance.marks import hooks, promise, tier

pytestmark = tier("basic")


@hooks("ds_launcher_visible_devices_env")
@promise(
    "ds_launcher_visible_devices_env",
    "Return the variables that restrict which devices a process sees",
)
@promise("ds_launcher_visible_devices_env", "the count the backend reports then follows it")
def test_visible_devices_variable_round_trips(acc: Any) -> None:
    names = acc.visible_devices_envs()
    check(
        all(isinstance(n, str) and n for n in names),
        "visible_devices_envs()",
        names,
        "a list of variable names",
        "ds_launcher_visible_devices_env",
    )
    if not names:
        pytest.skip(f"backend '{acc.name}' has no visible-devices variable (ranks are processes)")
    env: dict[str, str] = {}
    acc.set_visible_devices_envs(env, [0])
    check(
        all(env.get(n) == "0" for n in names),
        "env after set_visible_devices_envs([0])",
        env,
        "every variable = '0'",
        "set_visible_devices_envs",
    )
    result = run_python(
        "import json; from ds_core import get_accelerator; "
        "print(json.dumps(get_accelerator().device_count()))",
        env={names[0]: "0"},
    )
    check(
        result == 1, f"device_count() with {names[0]}=0", result, "1", "ds_device_count in a child"
    )


@hooks("ds_launcher_env_prefixes")
@promise(
    "ds_launcher_env_prefixes",
    "Return prefixes of environment variables a multi-node launcher forwards",
)
def test_env_prefixes_are_variable_prefixes(acc: Any) -> None:
    prefixes = acc.export_envs()
    check(
        all(isinstance(p, str) and p and "=" not in p for p in prefixes),
        "export_envs()",
        prefixes,
        "non-empty variable-name prefixes",
        "ds_launcher_env_prefixes",
    )
