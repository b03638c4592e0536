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
        tool.run(tool.sample(mutants, 1, seed=17), budget=60, select="full")
    assert roots and not roots[0].exists()
    assert _digest() == before


def test_report_table_and_survivors(mutants: list) -> None:
    m1, m2 = [x for x in mutants if x.category == "memory"][:2]
    outcomes = [tool.Outcome(m1, "killed", 1.0, "x"), tool.Outcome(m2, "survived", 1.0)]
    text = tool.markdown(outcomes, [], {"memory": 338})
    assert "| memory | 2 (338) | 1 | 1 | 0 | 50% |" in text
    assert m2.id in text and "→" in text


sel = tool.sel


def _memory_keys(tmp_path: Path, edit: tuple[str, str] | None = None) -> dict[str, int]:
    """key -> line of memory.py's mutants, after replacing ``edit[0]`` by ``edit[1]`` once."""
    source = (tool.PACKAGE / "memory.py").read_text()
    if edit is not None:
        assert source.count(edit[0]) == 1, edit[0]
        source = source.replace(edit[0], edit[1])
    (tmp_path / "memory.py").write_text(source)
    mutants = tool.enumerate_mutants(tmp_path, files=["memory.py"])
    keys = {m.key: m.line for m in mutants}
    assert len(keys) == len(mutants)
    return keys


def test_mutant_keys_are_unique_and_name_the_enclosing_definition(mutants: list) -> None:
    keys = [m.key for m in mutants]
    assert len(set(keys)) == len(keys)
    source = (tool.PACKAGE / "plugin.py").read_text()
    decorators = [m for m in mutants if m.operator == "RemoveDecorator" and m.file == "plugin.py"]
    assert decorators
    for m in decorators:  # a def's header (its decorators) is named by the def itself
        scope = m.key.split(":")[1]
        assert f"def {scope}(" in source and scope in "\n".join(source.splitlines()[m.line - 1 :])
    assert any(m.key.startswith("shm_sync.py:PythonFlags.") for m in mutants)


def test_a_key_survives_code_inserted_above_its_definition_and_statement(tmp_path: Path) -> None:
    before = _memory_keys(tmp_path)
    head = "def cgroup_limits(\n"
    extra = "def _extra(n: int) -> int:\n    return n + 1 if n > 0 else -n\n\n\n"
    body = '    """The cgroup v2 and v1 memory limits on this process, one per limited folder."""\n'
    after = _memory_keys(tmp_path, (head, extra + head))
    assert set(before) < set(after)
    new = set(after) - set(before)
    assert new and all(k.startswith("memory.py:_extra:") for k in new)
    moved = [k for k in before if k.startswith("memory.py:cgroup_limits:")]
    assert moved and all(after[k] == before[k] + 4 for k in moved)  # same key, new line
    # a statement added to the same function, above the others, leaves theirs as they were
    after = _memory_keys(tmp_path, (body, body + "    _spare = 1 + 2\n"))
    assert set(before) < set(after)
    assert all(k.startswith("memory.py:cgroup_limits:") for k in set(after) - set(before))


def test_a_key_changes_with_its_statement_and_only_its_statement(tmp_path: Path) -> None:
    before = _memory_keys(tmp_path)
    old = "                limits.append(Limit(source, limit, _read_int(d / usage_file) or 0))\n"
    line = (tool.PACKAGE / "memory.py").read_text().splitlines().index(old.rstrip("\n")) + 1
    on_line = {k for k, n in before.items() if n == line}
    assert on_line
    after = _memory_keys(tmp_path, (old, old.replace("or 0", "or 1")))
    assert set(before) - set(after) == on_line
    assert len(set(after) - set(before)) == len(on_line)
    # a comment or a reflow is no change of the statement (keys come from its syntax tree)
    reflowed = (
        "                limits.append(Limit(source, limit,  # set\n"
        "                                    _read_int(d / usage_file) or 0))\n"
    )
    assert set(_memory_keys(tmp_path, (old, reflowed))) == set(before)


def test_repeated_statements_in_one_definition_get_distinct_keys() -> None:
    source = "def f(x):\n    if x:\n        return 1\n    return 1\n"
    names = sel.StatementKeys(source)
    first, second = names.name(3, 15), names.name(4, 11)
    assert first.startswith("f:") and second == first + "~1"
    assert names.name(1, 4).startswith("f:")  # the def's own header
    keys = sel.mutant_keys("m.py", names, "NumberReplacer", [(3, 15), (4, 11)])
    assert keys[0] == f"m.py:f:NumberReplacer#0:{first[2:]}"
    assert keys[1] == f"m.py:f:NumberReplacer#0:{second[2:]}"
    with pytest.raises(ValueError, match="no statement holds line 9"):
        names.name(9, 0)


def test_list_prints_the_keys_and_mutant_runs_one_by_its_key(
    mutants: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tool, "enumerate_mutants", lambda: mutants)
    m = mutants[len(mutants) // 2]
    assert tool.main(["--list", "--mutant", m.key]) == 0
    out = capsys.readouterr().out
    assert m.key in out and out.count("\n") == 2  # the mutant's line and the count


def test_the_ledger_appends_keeps_the_last_record_and_skips_a_torn_last_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.jsonl"
    assert sel.read_ledger(path) == {}
    sel.append_ledger(path, {"key": "a", "status": "survived"})
    sel.append_ledger(path, {"key": "b", "status": "killed"})
    sel.append_ledger(path, {"key": "a", "status": "killed"})
    with open(path, "a") as f:
        f.write('{"key": "c", "sta')  # a run killed mid-write
    assert sel.read_ledger(path) == {
        "a": {"key": "a", "status": "killed"},
        "b": {"key": "b", "status": "killed"},
    }
    path.write_text('{"key": "c", "sta\n{"key": "d"}\n')
    with pytest.raises(SystemExit, match=r"ledger\.jsonl:1: not a JSON record"):
        sel.read_ledger(path)


def test_a_resumed_run_skips_every_mutant_its_ledger_holds(
    mutants: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = tool.sample(mutants, 1, seed=17)
    ledger = tmp_path / "ledger.jsonl"
    for m in chosen[1:]:
        sel.append_ledger(ledger, {"key": m.key, "status": "killed"})
    calls: list[tuple[str, object]] = []

    def fake(copy: object, category: str, timeout: float, extra=None, checks=None, server=None):
        calls.append((category, checks))
        mutated = any(
            (copy.copy / f).read_text() != (tool.PACKAGE / f).read_text()  # type: ignore[attr-defined]
            for f in tool.FILES
        )
        return ("killed", 0.5, "t") if mutated else ("survived", 0.5, "")  # baselines pass

    monkeypatch.setattr(tool, "run_suite", fake)
    outcomes, pending, _ = tool.run(chosen, budget=600, select="full", ledger=ledger)
    assert [o.mutant for o in outcomes] == chosen[:1] and not pending
    assert len(calls) == 2  # the category's baseline, then the one mutant not in the ledger
    records = sel.read_ledger(ledger)
    assert records[chosen[0].key]["status"] == "killed"
    assert records[chosen[0].key]["checks"] == "all"
    calls.clear()
    outcomes, _, _ = tool.run(chosen, budget=600, select="full", ledger=ledger)
    assert outcomes == [] and calls == []
    sel.append_ledger(ledger, {"key": chosen[1].key, "status": "timeout"})
    outcomes, _, _ = tool.run(chosen, 600, select="full", ledger=ledger, retry=("timeout",))
    assert [o.mutant for o in outcomes] == chosen[1:2]  # a loaded host's timeout, run again


def test_statement_spans_cover_a_multiline_statement_and_only_a_headers_lines() -> None:
    source = "x = f(\n    1,\n    2)\nif (a and\n        b):\n    y = 1\n"
    spans = sel.statement_spans(source)
    assert spans[2] == (1, 3) and spans[3] == (1, 3)
    assert spans[5] == (4, 5) and spans[6] == (6, 6)


def test_coverage_map_selects_the_checks_that_run_a_statement(tmp_path: Path) -> None:
    (tmp_path / "items.json").write_text(
        '{"t::a": {"arg": "/s/t.py::a", "case": null},'
        ' "t::b[k1]": {"arg": "/s/t.py::b[k1]", "case": "k1"},'
        ' "t::b[k2]": {"arg": "/s/t.py::b[k2]", "case": "k2"}}'
    )
    (tmp_path / "trace-1.tsv").write_text(
        "\tm.py\t3\nt::a\tm.py\t3\ncase:k2\tm.py\t5\n\tm.py\t9\nt::a\tm."
    )
    (tmp_path / "trace-2.tsv").write_text("case:k1\tm.py\t4\nt::gone\tm.py\t7\n")
    cov = sel.CoverageMap.from_traces(tmp_path, 1.5)
    cov = sel.CoverageMap.from_json(cov.to_json())
    assert cov.checks("m.py", (3, 3)) == ["/s/t.py::a"]  # also run outside: the check decides
    assert cov.checks("m.py", (3, 5)) == ["/s/t.py::a", "/s/t.py::b[k1]", "/s/t.py::b[k2]"]
    assert cov.checks("m.py", (6, 6)) == [] and cov.checks("other.py", (3, 3)) == []
    assert cov.checks("m.py", (9, 9)) is None  # run outside any one check: every check
    assert cov.checks("m.py", (7, 7)) is None  # a context no collected check owns


def test_the_tracer_records_each_line_under_the_context_of_the_check_and_its_children(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("def f(x):\n    if x:\n        return 1\n    return 2\n")
    traces = tmp_path / "traces"
    traces.mkdir()
    code = (
        "import os, subprocess, sys, sitecustomize, mod\n"
        "mod.f(0)\n"
        "sitecustomize.set_context('check-1')\n"
        "mod.f(1)\n"
        "subprocess.run([sys.executable, '-c', 'import mod; mod.f(0)'], check=True)\n"
    )
    paths = [str(tool.TRACER), str(pkg), *sys.path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), DS_MUT_TRACE_DIR=str(traces))
    env.update(DS_MUT_TRACE_PKG=str(pkg), DS_MUT_CONTEXT="")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (traces / "items.json").write_text('{"check-1": {"arg": "c1", "case": null}}')
    lines = sel.CoverageMap.from_traces(traces, 0.0).lines["mod.py"]
    assert "" in lines[1]  # the def runs at import, outside any check
    assert lines[2] == {"", "check-1"} and lines[3] == {"check-1"}
    assert lines[4] == {"", "check-1"}  # f(0) in the child inherits the check's context


def test_summary_counts_per_category_from_the_ledger() -> None:
    records = [
        {"key": "a", "category": "op", "status": "killed"},
        {"key": "b", "category": "op", "status": "crash"},
        {"key": "c", "category": "op", "status": "survived", "detail": sel.NOT_COVERED},
        {"key": "d", "category": "op", "status": "survived", "detail": ""},
        {"key": "e", "category": "op", "status": "unchanged"},
    ]
    text = sel.summary(records, {"op": 7, "rng": 2}, {"d": "same values"})
    assert "| op | 7 | 4 | 2 (0) | 2 (1) | 1 | 2 | 2/3 = 66.7% |" in text
    assert "| rng | 2 | 0 | 0 (0) | 0 (0) | 0 | 2 | – |" in text


def test_the_fork_server_reports_pass_fail_and_kills_a_run_past_its_timeout(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_x.py").write_text(
        "import os, time\n"
        "def test_pass(): assert os.environ['MARK'] == '1'\n"
        "def test_fail(): assert False\n"
        "def test_hang(): time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    server = tool.ForkServer(tool.PRELOAD, env, forbid=["ds_backend_"])
    try:
        base = ["-q", "-p", "no:cacheprovider", "-o", "addopts="]

        def run(name: str, timeout: float) -> int | None:
            args = [*base, f"{tmp_path}/test_x.py::{name}"]
            log = tmp_path / "log"
            code: int | None = server.run(
                "pytest:main", args, log, timeout, {"MARK": "1"}, cwd=tmp_path
            )
            return code

        assert run("test_pass", 120) == 0
        assert "1 passed" in (tmp_path / "log").read_text()
        assert run("test_fail", 120) == 1
        assert run("test_hang", 3) is None
        assert run("test_pass", 120) == 0  # the server goes on after a timeout
    finally:
        server.close()


def test_a_survivor_of_a_selection_is_confirmed_on_the_whole_suite(
    mutants: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = next(x for x in mutants if x.category == "memory")
    span = sel.statement_spans((tool.PACKAGE / m.file).read_text()).get(m.line, (m.line,) * 2)
    cov = sel.CoverageMap({m.file: {span[0]: {"t::a"}}}, {"t::a": {"arg": "A", "case": None}}, 2)
    monkeypatch.setattr(tool, "coverage_map", lambda *a: cov)
    calls: list[object] = []

    def fake(copy: object, category: str, timeout: float, extra=None, checks=None, server=None):
        calls.append(checks)
        return ("survived", 1.0, "") if checks else ("killed", 2.0, "memory/test_b")

    monkeypatch.setattr(tool, "run_suite", fake)
    ledger = tmp_path / "ledger.jsonl"
    outcomes, _, _ = tool.run([m], budget=600, ledger=ledger)
    assert calls == [["A"], None]
    assert (outcomes[0].status, outcomes[0].detail) == ("killed", "memory/test_b")
    assert sel.read_ledger(ledger)[m.key]["checks"] == "1+all"
