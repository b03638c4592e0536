"""Helpers shared by the backends' contract tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Collection
from typing import Any


def probe_in_subprocess(module: str, vendor: Collection[str] = ()) -> dict[str, Any]:
    """Import a backend's plugin module in a fresh interpreter and call its probe there.

    ``DS_ACCELERATOR`` is removed from the child's environment. The child imports ``module``,
    calls ``module.hooks.ds_backend_probe()``, then imports torch and reports:

    - ``available``, ``reason``, ``device_count``, ``probe_imported``: the probe's result
      (``probe_imported`` is ``ProbeResult.imported``);
    - ``imported``: the modules that importing ``module`` and probing added to ``sys.modules``;
    - ``vendor``: every module in ``sys.modules`` whose top-level name is in ``vendor``;
    - ``initialized``: ``torch.cuda.is_initialized()`` after the probe.
    """
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        f"import {module} as p\n"
        "r = p.hooks.ds_backend_probe()\n"
        "import torch\n"
        f"roots = {sorted(vendor)!r}\n"
        "print(json.dumps({'available': r.available, 'reason': r.reason, "
        "'device_count': r.device_count, 'probe_imported': list(r.imported), "
        "'imported': sorted(set(sys.modules) - before), "
        "'vendor': sorted(m for m in sys.modules if m.split('.')[0] in roots), "
        "'initialized': bool(torch.cuda.is_initialized())}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
