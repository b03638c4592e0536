"""Import hygiene and the hooks-only rule (docs/architecture.md §1.1)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

VENDOR_MODULES = ("torch_npu", "habana_frameworks", "intel_extension_for_pytorch", "torch_xmlir")
ROOT = Path(__file__).resolve().parents[1]

# Vendor APIs and non-host device literals; "cpu" is allowed. Kept in step with the
# before-stop hook's scan.
VENDOR_PATTERN = re.compile(
    r"torch\.(cuda|xpu|npu|hpu|mlu)\b|\.cuda\(|['\"](cuda|xpu|npu|hpu|mlu)(:[0-9]+)?['\"]"
    r"|torch_npu|habana_frameworks|torch_xmlir|intel_extension_for_pytorch|oneccl_bindings"
)


def imported_after(code: str) -> set[str]:
    probe = f"import sys; before = set(sys.modules)\n{code}\nimport json; print(json.dumps(sorted(set(sys.modules) - before)))"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_ds_core_imports_no_backend_and_no_vendor_module() -> None:
    mods = imported_after("import ds_core")
    assert not {m for m in mods if m.startswith("ds_backend_")}
    assert not {m for m in mods if m.split(".")[0] in VENDOR_MODULES}


@pytest.mark.slow  # a fresh interpreter per backend
def test_importing_each_installed_backend_plugin_imports_no_vendor_module() -> None:
    targets = [ep.value for ep in md.entry_points(group="ds_core.backends")]
    assert "ds_backend_cpu.plugin" in targets
    for target in targets:
        mods = imported_after(f"import {target.split(':')[0]}")
        vendor = {m for m in mods if m.split(".")[0] in VENDOR_MODULES}
        assert not vendor, f"{target} imported {sorted(vendor)}"


def test_the_core_names_no_vendor_outside_hookspecs_and_known_backends() -> None:
    allowed = {ROOT / "ds_core" / "known_backends.py"}
    offenders = []
    for path in sorted((ROOT / "ds_core").rglob("*.py")):
        if "hookspecs" in path.parts or path in allowed:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if VENDOR_PATTERN.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "the core names a vendor:\n" + "\n".join(offenders)


def test_the_scan_would_catch_a_vendor_call() -> None:
    for line in (
        "x = torch.cuda.current_device()",
        'device = "cuda:0"',
        "t.cuda()",
        "import torch_npu",
    ):
        assert VENDOR_PATTERN.search(line), line
    assert not VENDOR_PATTERN.search('device = "cpu"')
