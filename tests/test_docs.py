"""Every module, path and CLI command README.md and docs/ name exists, or is marked planned.

A line that names something not built yet says so with the word "planned"; the check skips
it. Placeholders (``<name>``, ``NAME``, ``<category>``) are not paths to check.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from ds_core import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: repository paths: ds_core/..., backends/..., bench/..., ...
PATH = re.compile(
    r"(?<![\w./-])((?:ds_core|backends|bench|examples|tests|conformance|docs|tools)/[\w./<>-]*)"
)
#: dotted names under ds_core (modules, or attributes of one)
DOTTED = re.compile(r"(?<![\w./-])(ds_core(?:\.\w+)+)")
#: a CLI command: `ds-core <command>`
COMMAND = re.compile(r"\bds-core ([a-z][a-z-]*)")
#: names of entry-point groups, which are not modules
ENTRY_POINT_GROUPS = {"ds_core.backends", "ds_core.plugins"}
PLACEHOLDER = re.compile(r"<\w+>|\bNAME\b|\bN\b|\bT\b")


def mentions() -> list[tuple[str, int, str, str]]:
    """``(file, line number, kind, name)`` of everything the docs name, off "planned" lines."""
    found = []
    for doc in DOCS:
        rel = str(doc.relative_to(ROOT))
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            if "planned" in line.lower():
                continue
            found += [(rel, lineno, "path", m.rstrip(".,:;)")) for m in PATH.findall(line)]
            found += [(rel, lineno, "dotted", m) for m in DOTTED.findall(line)]
            found += [(rel, lineno, "command", m) for m in COMMAND.findall(line)]
    return found


def exists(kind: str, name: str) -> bool:
    if kind == "command":
        return name in cli._commands()
    if kind == "path":
        if PLACEHOLDER.search(name):
            parent = name[: PLACEHOLDER.search(name).start()]  # type: ignore[union-attr]
            return (ROOT / parent).exists()
        return (ROOT / name).exists()
    if name in ENTRY_POINT_GROUPS:
        return True
    module, _, attr = name, "", ""
    while module:
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            module, _, last = module.rpartition(".")
            attr = f"{last}.{attr}" if attr else last
            continue
        for part in filter(None, attr.split(".")):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_the_docs_name_only_what_exists_or_is_planned() -> None:
    missing = [
        f"{f}:{n}: {kind} {name}" for f, n, kind, name in mentions() if not exists(kind, name)
    ]
    assert not missing, "docs name things that do not exist (build them or mark 'planned'):\n" + (
        "\n".join(missing)
    )


def test_the_docs_name_modules_and_commands_at_all() -> None:
    kinds = {kind for _, _, kind, _ in mentions()}
    assert kinds == {"path", "dotted", "command"}


@pytest.mark.parametrize(
    ("kind", "name", "ok"),
    [
        ("path", "ds_core/hookspecs/", True),
        ("path", "ds_core/facade.py", True),
        ("path", "ds_core/teleport.py", False),
        ("path", "backends/<name>/", True),
        ("dotted", "ds_core.get_accelerator", True),
        ("dotted", "ds_core.comm.groups.new_group", True),
        ("dotted", "ds_core.teleport", False),
        ("dotted", "ds_core.backends", True),
        ("command", "report", True),
        ("command", "teleport", False),
    ],
)
def test_the_check_itself(kind: str, name: str, ok: bool) -> None:
    assert exists(kind, name) is ok


def test_the_readme_python_snippet_runs_as_pasted(tmp_path: Path) -> None:
    import os
    import re
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no Python snippet"
    for i, block in enumerate(blocks):
        proc = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (i, proc.stderr[-3000:])


def test_the_readme_says_how_long_the_tests_take_and_the_fast_subset() -> None:
    text = (ROOT / "README.md").read_text()
    assert "about 20 minutes on 2 cores" in text
    assert 'pytest -m "not slow"' in text
    assert '"slow:' in (ROOT / "pyproject.toml").read_text()  # the marker the README names


def test_the_backend_guide_installs_the_suite_from_the_checkout() -> None:
    guide = (ROOT / "docs" / "writing-a-backend.md").read_text()
    assert 'pip install "ds-core[conformance]"' not in guide  # not on the index
    assert "pip install -e . -e conformance" in guide
    assert "ties with" in guide or "a tie" in guide
