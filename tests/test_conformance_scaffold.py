"""``ds-core new-backend``: the package it writes installs as is and passes the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ds_core.cli import main
from ds_core.scaffold import write_backend


def test_writes_a_complete_package(tmp_path: Path) -> None:
    root = write_backend("acme", "cpu", tmp_path)
    assert root == tmp_path / "ds-core-acme"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "ds_backend_acme/__init__.py",
        "ds_backend_acme/conformance-xfail.txt",
        "ds_backend_acme/plugin.py",
        "pyproject.toml",
    ]
    assert 'acme = "ds_backend_acme.plugin:hooks"' in (root / "pyproject.toml").read_text()
    assert "ds-core conformance --backend acme" in (root / "README.md").read_text()
    plugin = (root / "ds_backend_acme/plugin.py").read_text()
    assert "TODO" not in plugin and "NotImplementedError" not in plugin
    compile(plugin, "plugin.py", "exec")


def test_generated_code_is_lint_clean_and_formatted(tmp_path: Path) -> None:
    write_backend("acme", "cpu", tmp_path)
    write_backend("chip", "privateuseone", tmp_path)
    # The project's lint rules, rooted at the generated packages: there ds_core is third-party.
    config = tmp_path / "ruff.toml"
    config.write_text(
        'line-length = 100\ntarget-version = "py310"\n[lint]\n'
        'select = ["E", "F", "W", "I", "B", "UP", "N", "RUF"]\nignore = ["E501", "RUF001"]\n'
    )
    for command in (["check"], ["format", "--check"]):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ruff",
                *command,
                "--no-cache",
                "--config",
                config,
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_device_template_delegates_to_the_torch_device_module(tmp_path: Path) -> None:
    root = write_backend("chip", "privateuseone", tmp_path)
    plugin = (root / "ds_backend_chip/plugin.py").read_text()
    compile(plugin, "plugin.py", "exec")
    assert (
        'DEVICE_TYPE = "privateuseone"' in plugin and "class ChipHooks(TorchStyleHooks)" in plugin
    )
    assert 'VISIBLE_DEVICES_ENV = "PRIVATEUSEONE_VISIBLE_DEVICES"' in plugin


def test_refuses_bad_names_and_existing_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be lowercase letters"):
        write_backend("Acme-1", "cpu", tmp_path)
    write_backend("acme", "cpu", tmp_path)
    with pytest.raises(FileExistsError, match="already exists"):
        write_backend("acme", "cpu", tmp_path)
    assert main(["new-backend", "acme", "--output", str(tmp_path)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds-core-acme"]  # nothing half-written


@pytest.mark.slow
def test_generated_backend_installs_and_passes_the_suite_in_a_fresh_venv(tmp_path: Path) -> None:
    assert main(["new-backend", "acme", "--device-type", "cpu", "--output", str(tmp_path)]) == 0
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The new venv sees this venv's packages (torch, ds-core, the suite) through a .pth that
    # adds our site directory, so nothing is downloaded and torch is not reinstalled.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(purelib) / "_ds_parent_site.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-build-isolation", str(tmp_path / "ds-core-acme")],
        check=True,
    )  # fmt: skip
    report = tmp_path / "report"
    proc = subprocess.run(
        [str(python), "-m", "ds_core.cli", "conformance", "--backend", "acme", "--report",
         str(report)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads((report / "conformance.json").read_text())
    assert data["backend"]["distribution"] == "ds-core-acme" and data["conformant"] is True
    assert "site-packages/ds_backend_acme" in data["xfail"]["file"]  # installed, not the source
    assert data["totals"]["passed"] > 100 and data["totals"]["failed"] == 0
