"""The mutation tool (``tools/conformance_mutation.py``) itself; fast: no suite run.

It must enumerate and sample mutants deterministically, map them to categories, apply one
mutant to a copy only (the backend's own files never change) and remove the copy even when
the run is interrupted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "conformance_mutation", ROOT / "tools/conformance_mutation.py"
)
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
sys.modules["conformance_mutation"] = tool
_spec.loader.exec_module(tool)


def _digest() -> str:
    h = hashlib.sha256()
    for file in sorted(tool.FILES):
        h.update((tool.PACKAGE / file).read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def mutants() -> list:
    return tool.enumerate_mutants()


def test_enumeration_and_sampling_are_deterministic(mutants: list) -> None:
    assert mutants == tool.enumerate_mutants()
    assert len(set(mutants)) == len(mutants)
    a, b = tool.sample(mutants, 4, seed=17), tool.sample(mutants, 4, seed=17)
    assert a == b
    assert tool.sample(mutants, 4, seed=18) != a
    cats = {m.category for m in mutants}
    assert {"memory", "graph", "comm", "device", "rng", "determinism", "backend"} <= cats
    assert cats <= set(tool.SECTIONS.values())
    for cat in cats:
        n = sum(m.category == cat for m in mutants)
        assert sum(m.category == cat for m in a) == min(4, n)


def test_categories_follow_files_and_plugin_sections(mutants: list) -> None:
    by_file = {m.file: set() for m in mutants}
    for m in mutants:
        by_file[m.file].add(m.category)
    assert by_file["memory.py"] == {"memory"}
    assert by_file["graph.py"] == {"graph"}
    assert by_file["shm.py"] == {"comm"}
    source = (tool.PACKAGE / "plugin.py").read_text().splitlines()
    checked = 0
    for m in mutants:
        if m.file != "plugin.py":
            continue
        defs = [t for t in source[: m.line] if t.startswith(("def ", "class ", "@"))]
        if defs and defs[-1].startswith("def ds_"):  # inside a hook: its ds_<group>_ name
            assert m.category == defs[-1].split("_")[1], (m, defs[-1])
            checked += 1
    assert checked > 20


def test_no_mutant_inside_an_annotation(mutants: list) -> None:
    # `int | None` in a signature is never evaluated (from __future__ import annotations)
    for m in mutants:
        if m.operator.startswith("ReplaceBinaryOperator_BitOr"):
            line = (tool.PACKAGE / m.file).read_text().splitlines()[m.line - 1]
            assert "| None" not in line or "=" in line.split("| None")[0], (m, line)


def test_a_mutant_changes_only_the_copy_and_the_copy_is_removed(mutants: list) -> None:
    before = _digest()
    m = next(x for x in mutants if x.file == "memory.py")
    with tool.MutantCopy() as copy:
        text = copy.apply(m)
        assert text is not None and text != (tool.PACKAGE / m.file).read_text()
        assert (copy.copy / m.file).read_text() == text
        copy.apply(None)
        assert (copy.copy / m.file).read_text() == (tool.PACKAGE / m.file).read_text()
        copy.apply(m)
        root = copy.root
        # the copy shadows the installed (editable) package for a subprocess
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *sys.path]))
        out = subprocess.run(
            [sys.executable, "-c", "import ds_backend_cpu; print(ds_backend_cpu.__file__)"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip().startswith(str(root))
    assert not root.exists()
    assert _digest() == before


def test_an_interrupted_run_leaves_no_copy_and_no_mutated_file(
    mutants: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _digest()
    roots: list[Path] = []

    def interrupted(copy: object, *args: object) -> tuple[str, float, str]:
        roots.append(copy.root)  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(tool, "run_suite", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tool.run(tool.sample(mutants, 1, seed=17), budget=60)
    assert roots and not roots[0].exists()
    assert _digest() == before


def test_report_table_and_survivors(mutants: list) -> None:
    m1, m2 = [x for x in mutants if x.category == "memory"][:2]
    outcomes = [tool.Outcome(m1, "killed", 1.0, "x"), tool.Outcome(m2, "survived", 1.0)]
    text = tool.markdown(outcomes, [], {"memory": 338})
    assert "| memory | 2 (338) | 1 | 1 | 0 | 50% |" in text
    assert m2.id in text and "→" in text
