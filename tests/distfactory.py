"""Write small, real backend distributions for tests.

Each call creates ``<root>/<module>.py`` and ``<root>/<dist>-<version>.dist-info`` with an
``entry_points.txt`` in the ``ds_core.backends`` group, so ``importlib.metadata`` discovers it
exactly like an installed wheel once ``root`` is on ``sys.path`` (or ``PYTHONPATH``).
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

from ds_core.hookspecs import HOOKSPEC_VERSION

# A module body that reuses the CPU backend's hooks and re-identifies itself. Tests append
# overrides after it.
CPU_CLONE = """
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from ds_backend_cpu import plugin as _cpu
from ds_core import hookimpl
from ds_core.types import BackendInfo, ProbeResult

@hookimpl
def ds_backend_info():
    return BackendInfo(name={name!r}, device_type={device_type!r}, priority={priority},
                       hookspec_version={version}, description="test backend")

@hookimpl
def ds_backend_probe():
    return ProbeResult({available!r}, {reason!r}, 1 if {available!r} else 0)
"""


def make_backend(
    root: Path,
    name: str,
    *,
    dist: str | None = None,
    version: str = "0.0.1",
    module: str | None = None,
    device_type: str = "cpu",
    priority: int = 0,
    available: bool = True,
    reason: str = "test backend present",
    hookspec_version: int = HOOKSPEC_VERSION,
    extra: str = "",
    body: str | None = None,
) -> str:
    """Create a backend distribution in ``root``; return its module name."""
    dist = dist or f"ds-core-test-{name}"
    module = module or f"ds_test_backend_{name}_{uuid.uuid4().hex[:8]}"
    source = (
        body
        if body is not None
        else CPU_CLONE.format(
            name=name,
            device_type=device_type,
            priority=priority,
            version=hookspec_version,
            available=available,
            reason=reason,
        )
    )
    (root / f"{module}.py").write_text(textwrap.dedent(source) + textwrap.dedent(extra))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ds_core.backends]\n{name} = {module}\n")
    return module


def forget(modules: list[str]) -> None:
    for m in modules:
        sys.modules.pop(m, None)
