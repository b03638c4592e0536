"""Assertion and process helpers shared by the suite's tests.

Messages have one shape: ``{what}={actual}, but should be {expected} [{call}]``, so a vendor
reading a failure needs no knowledge of how the test is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

MiB = 2**20


def check(ok: bool, what: str, actual: Any, expected: str, call: str) -> None:
    """Fail with the suite's message shape unless ``ok``."""
    __tracebackhide__ = True
    if not ok:
        pytest.fail(f"{what}={actual!r}, but should be {expected} [{call}]", pytrace=False)


def run_python(
    code: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    base_env: dict[str, str] | None = None,
) -> Any:
    """Run ``code`` in a fresh interpreter and return the JSON it prints on its last line.

    The child inherits ``DS_ACCELERATOR`` (the backend under test) and ``sys.path``; its
    environment is ``base_env`` (default: this process's) updated with ``env``.

    :raises pytest.fail.Exception: when the child exits non-zero, hangs past ``timeout``
        seconds, or prints no JSON; the message carries the tail of its stderr.
    """
    __tracebackhide__ = True
    child_env = dict(os.environ if base_env is None else base_env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    child_env.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"child process ran past {timeout} s (hung?)", pytrace=False)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
        pytest.fail(f"child process exited with {proc.returncode}: {tail}", pytrace=False)
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        pytest.fail(f"child process printed no JSON result: {proc.stdout[-300:]!r}", pytrace=False)


# The measurement a probe or a compatibility check is judged by, run in a fresh interpreter
# after torch and ds_core are imported (the baseline every backend may rely on).
SNAPSHOT = """
import json, os, sys, threading
import torch, ds_core, ds_core.plugins, ds_core.accelerator
def _threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
def _libs():
    try:
        with open("/proc/self/maps") as f:
            return {l.split()[-1] for l in f if ".so" in l}
    except OSError:
        return set()
def _contexts(device_type):
    found = []
    for name in {device_type, "cuda"} - {"cpu"}:
        module = getattr(torch, name, None)
        check = getattr(module, "is_initialized", None)
        if check is not None and check():
            found.append(f"torch.{name}.is_initialized() is True")
    return found
def snapshot():
    return set(sys.modules), _threads(), _libs()
def diff(before, device_type):
    mods, threads, libs = before
    new_mods = sorted({m.split(".")[0] for m in set(sys.modules) - mods})
    new_libs = sorted(os.path.basename(l) for l in _libs() - libs)
    return {
        "new_modules": new_mods,
        "stdlib": sorted(set(new_mods) & set(sys.stdlib_module_names)),
        "new_threads": _threads() - threads,
        "new_driver_libs": [l for l in new_libs if l.startswith(DRIVER_LIBS)],
        "contexts": _contexts(device_type),
    }
# Native libraries whose loading means a device runtime was initialised (not a management
# library: NVML is allowed in probes).
DRIVER_LIBS = ("libcuda.so",)
"""


def undocumented_modules(result: dict[str, Any], allowed: set[str]) -> list[str]:
    """Third-party top-level modules in ``result['new_modules']`` not in ``allowed``."""
    skip = set(result["stdlib"]) | {"torch", "ds_core"} | allowed
    return [m for m in result["new_modules"] if m not in skip and not m.startswith("_")]
