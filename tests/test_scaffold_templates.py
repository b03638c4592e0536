"""The scaffold's templates: real files, shipped in the wheel, rendering type-correct code."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ds_core import scaffold
from ds_core.scaffold import write_backend

ROOT = Path(__file__).resolve().parents[1]
TOKENS = ("template_backend", "TemplateBackend", "template_device", "TEMPLATE_DEVICE")


def test_rendered_packages_have_no_template_token_left(tmp_path: Path) -> None:
    for name, device in (("acme", "cpu"), ("my_chip", "privateuseone")):
        root = write_backend(name, device, tmp_path)
        for path in root.rglob("*"):
            if path.is_file():
                text = path.read_text()
                assert not [t for t in TOKENS if t in text], path
    plugin = (tmp_path / "ds-core-my-chip" / "ds_backend_my_chip" / "plugin.py").read_text()
    assert "class MyChipHooks(TorchStyleHooks)" in plugin
    assert 'VISIBLE_DEVICES_ENV = "PRIVATEUSEONE_VISIBLE_DEVICES"' in plugin


@pytest.mark.slow  # mypy --strict in a subprocess
def test_rendered_packages_pass_mypy_strict(tmp_path: Path) -> None:
    write_backend("acme", "cpu", tmp_path)
    write_backend("chip", "privateuseone", tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports", "silent",
         "--cache-dir", str(ROOT / ".mypy_cache"),
         str(tmp_path / "ds-core-acme" / "ds_backend_acme"),
         str(tmp_path / "ds-core-chip" / "ds_backend_chip")],
        capture_output=True, text=True, cwd=tmp_path,
        # ds_core is installed in editable mode, which mypy cannot follow: point it at the tree
        env={**os.environ, "MYPYPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_wheel_ships_every_template(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("ds_core-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {*scaffold._FILES.values(), "plugin_host.py", "plugin_device.py"}
    assert {f"ds_core/scaffold_templates/{n}" for n in needed} <= names
