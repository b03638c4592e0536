"""Every module, path and CLI command README.md and docs/ name exists, or is marked planned.

A line that names something not built yet says so with the word "planned"; the check skips
it. Placeholders (``<name>``, ``NAME``, ``<category>``) are not paths to check.

Citations hold too: no tracked file cites the design file that used to live outside the
repository, every cited ``docs/`` page exists, and every section of docs/architecture.md cited
by number is a heading there.
"""

from __future__ import annotations

import importlib
import re
import subprocess
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

#: the design document that lived outside the repository (spelled in two parts so this file
#: does not cite it); docs/architecture.md replaces it
OLD_DESIGN = "DESIGN" + ".md"
ARCHITECTURE = "docs/architecture.md"
#: a cited page of docs/ (relative to the repository root)
DOC_CITATION = re.compile(r"(?<![\w./-])(docs/[\w./-]*?\.md)\b")
#: ``docs/architecture.md §3.2``, and lists after it: ``§3.1, §4``, ``§3 and §5.2``
ARCHITECTURE_CITATION = re.compile(
    re.escape(ARCHITECTURE) + r"((?:(?:\s|,|and\b|or\b)*§\d+(?:\.\d+)*)+)"
)
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
#: a numbered heading: ``## 3. Decisions``, ``### 3.2 fp32 ...``
NUMBERED_HEADING = re.compile(r"^#{2,6} (\d+(?:\.\d+)*)\.? ", re.M)


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
    # The figure changes as the suite grows; what must stay is that one is stated.
    assert re.search(r"takes about \d+ minutes on 2 cores", text), "README: state the suite's time"
    assert 'pytest -m "not slow"' in text
    assert '"slow:' in (ROOT / "pyproject.toml").read_text()  # the marker the README names


def test_the_backend_guide_installs_the_suite_from_the_checkout() -> None:
    guide = (ROOT / "docs" / "writing-a-backend.md").read_text()
    assert 'pip install "ds-core[conformance]"' not in guide  # not on the index
    assert "pip install -e . -e conformance" in guide
    assert "ties with" in guide or "a tie" in guide


# --------------------------------------------------------------------------- citations


def tracked_texts() -> list[tuple[str, str]]:
    """``(path, text)`` of every tracked text file (``git ls-files``) present in the tree."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = []
    for name in filter(None, out.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" not in data:  # binary files cite nothing
            texts.append((name, data.decode("utf-8", errors="replace")))
    return texts


def architecture_sections() -> set[str]:
    """Section numbers of docs/architecture.md's headings (``"3"``, ``"3.2"``, ...)."""
    return set(NUMBERED_HEADING.findall((ROOT / ARCHITECTURE).read_text()))


def broken_citations(name: str, text: str, sections: set[str]) -> list[str]:
    """Problems with ``text``'s citations: the old design file, a missing docs page, or a
    section of docs/architecture.md that has no heading. In docs/architecture.md itself a
    bare ``§N`` is a citation of its own section."""
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{name}:{lineno}"
        if OLD_DESIGN in line:
            problems.append(f"{where}: cites {OLD_DESIGN}; cite {ARCHITECTURE} §N instead")
        for page in DOC_CITATION.findall(line):
            if not (ROOT / page).is_file():
                problems.append(f"{where}: cites {page}, which does not exist")
        cited = [m for group in ARCHITECTURE_CITATION.findall(line) for m in SECTION.findall(group)]
        if name == ARCHITECTURE:
            cited = SECTION.findall(line)
        problems += [
            f"{where}: cites {ARCHITECTURE} §{n}, which has no such heading"
            for n in cited
            if n not in sections
        ]
    return problems


def test_citations_name_only_what_the_repository_holds() -> None:
    sections = architecture_sections()
    problems = [p for name, text in tracked_texts() for p in broken_citations(name, text, sections)]
    assert not problems, "broken citations:\n" + "\n".join(problems)


def test_the_architecture_has_numbered_sections() -> None:
    sections = architecture_sections()
    assert {"1", "2", "3", "3.1", "3.2", "4", "5", "9"} <= sections, sorted(sections)


@pytest.mark.parametrize(
    ("line", "ok"),
    [
        (f"see {ARCHITECTURE} §3.2", True),
        (f"see {ARCHITECTURE} §3.1, §4 and §5.4", True),
        (f"see {ARCHITECTURE} §3.99", False),
        (f"see {ARCHITECTURE} §3.1, §42", False),
        ("see docs/checkpoints.md", True),
        ("see docs/" + "teleport.md", False),
        (f"see {OLD_DESIGN} §3", False),
        ("issue 28 §3, and §99 of another file", True),
    ],
    ids=lambda v: None if isinstance(v, bool) else str(v).replace(OLD_DESIGN, "old design file"),
)
def test_the_citation_check_itself(line: str, ok: bool) -> None:
    problems = broken_citations("x.py", line, architecture_sections())
    assert (problems == []) is ok, problems
