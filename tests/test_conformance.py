"""The conformance suite itself: CPU passes, both entry points, xfail file, report, coverage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ds_conformance import coverage, xfail
from ds_conformance import report as rep

from ds_core.cli import main
from ds_core.hookspecs import HOOKSPEC_VERSION

CATEGORIES = {
    "backend", "comm", "determinism", "device", "dtype", "graph",
    "hygiene", "launcher", "memory", "op", "profiler", "rng", "stream", "zero",
}  # fmt: skip


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)  # the suite must select the backend it is given
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_cpu_passes_everything_it_claims_and_writes_both_reports(tmp_path: Path) -> None:
    proc = _run("-m", "ds_core.cli", "conformance", "--backend", "cpu", "--report", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "conformance.json").read_text())
    markdown = (tmp_path / "conformance.md").read_text()
    assert report["conformant"] is True and report["totals"]["failed"] == 0
    assert set(report["categories"]) == CATEGORIES
    assert report["hookspec_version"] == HOOKSPEC_VERSION
    assert report["versions"]["torch"] and report["versions"]["backend"] == "0.1.0"
    assert report["device"]["type"] == "cpu" and report["device"]["count"] >= 1
    assert report["categories"]["graph"]["passed"] > 0  # graph capture is declared and works
    declared = xfail.parse(xfail.backend_file("ds_backend_cpu.plugin").read_text())  # type: ignore[union-attr]
    assert report["totals"]["xfailed"] == len(declared)
    assert report["categories"]["comm"]["passed"] >= 100  # 2 and 4 ranks, every claimed dtype
    absent = [t for t in report["tests"] if t["reason"] == "capability absent: pinned_memory"]
    assert absent and all(t["outcome"] == "skipped" for t in absent)
    assert "| category | passed |" in markdown and "**conformant**" in markdown
    # the CLI prints the Markdown report last
    assert proc.stdout.rstrip().splitlines()[-1].startswith("reports: ")
    assert "| **total** |" in proc.stdout


@pytest.mark.slow
def test_pytest_entry_point_runs_the_same_tests(tmp_path: Path) -> None:
    proc = _run(
        "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "--pyargs", "ds_conformance",
        "--ds-backend", "cpu", "--ds-category", "rng", "--ds-report", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "ds_core conformance: cpu" in proc.stdout
    report = json.loads((tmp_path / "conformance.json").read_text())
    assert set(report["categories"]) == {"rng"}
    # the printed table is the report's: rng's passed count, as many as the category ran
    passed = report["categories"]["rng"]["passed"]
    assert passed > 0 and f"| rng | {passed} |" in proc.stdout, proc.stdout[-2000:]


def test_suite_refuses_to_run_without_a_backend() -> None:
    proc = _run(
        "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "--pyargs", "ds_conformance", "-q"
    )  # fmt: skip
    assert proc.returncode == 4, proc.stdout[-2000:]
    assert "need a backend: pass --ds-backend NAME" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_xfail_file_strict_mode_fails_unexpected_passes_and_stale_entries(
    tmp_path: Path,
) -> None:
    xfails = tmp_path / "xfail.txt"
    xfails.write_text(
        "# passes on cpu, so it is an unexpected pass\n"
        "rng/test_seed_reproduces_draws  pretend it fails\n"
        "rng/test_no_such_test  stale entry\n"
    )
    common = ["-m", "ds_core.cli", "conformance", "--backend", "cpu", "--category", "rng"]
    common += ["--xfail-file", str(xfails)]
    lenient = _run(*common, "--report", str(tmp_path / "lenient"))
    assert lenient.returncode == 0, lenient.stdout[-3000:]
    assert "'rng/test_no_such_test' matches no conformance test" in lenient.stdout
    report = json.loads((tmp_path / "lenient" / "conformance.json").read_text())
    assert report["categories"]["rng"]["xpassed"] == 1
    assert report["xfail"]["stale"] == ["rng/test_no_such_test"]

    strict = _run(*common, "--strict", "--report", str(tmp_path / "strict"))
    assert strict.returncode == 1, strict.stdout[-3000:]
    report = json.loads((tmp_path / "strict" / "conformance.json").read_text())
    assert report["categories"]["rng"]["failed"] == 1  # XPASS(strict)
    assert report["categories"]["xfail-file"]["failures"][0]["id"] == (
        "xfail-file/rng/test_no_such_test"
    )


def test_cli_says_how_to_install_the_suite_when_absent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ds_conformance.runner", None)
    assert main(["conformance", "--backend", "cpu"]) == 2
    assert "pip install -e conformance" in capsys.readouterr().err


# --------------------------------------------------------------------------- xfail file


def test_xfail_file_parses_ids_reasons_and_comments() -> None:
    entries = xfail.parse(
        "# header\n\ncomm/test_all_reduce[sum-int16-w2]  gloo lacks int16\n"
        "memory/test_peak  # no reason given\nrng/test_x\tneeds a fix\n"
    )
    assert [(e.test_id, e.reason, e.line) for e in entries] == [
        ("comm/test_all_reduce[sum-int16-w2]", "gloo lacks int16", 3),
        ("memory/test_peak", "no reason given", 4),
        ("rng/test_x", "needs a fix", 5),
    ]
    assert entries[0].matches("comm/test_all_reduce[sum-int16-w2]")
    assert not entries[0].matches("comm/test_all_reduce[sum-int16-w4]")
    assert entries[1].matches("memory/test_peak[a]") and entries[1].matches("memory/test_peak")
    assert not entries[1].matches("memory/test_peak_other")


def test_xfail_file_rejects_a_line_that_is_not_a_test_id() -> None:
    with pytest.raises(ValueError, match=r"x.txt:2: 'test_all_reduce' is not a test id"):
        xfail.parse("# ok\ntest_all_reduce  reason\n", "x.txt")


def test_cpu_backend_ships_its_xfail_file() -> None:
    path = xfail.backend_file("ds_backend_cpu.plugin")
    assert path is not None and path.name == "conformance-xfail.txt"
    assert path.read_text().startswith("# Expected conformance failures of the CPU backend")
    xfail.parse(path.read_text(), str(path))  # well-formed


# --------------------------------------------------------------------------- report


def test_report_counts_per_category_and_lists_failures() -> None:
    results = rep.Results()
    results.record("memory/a", "memory", "passed")
    results.record("memory/b", "memory", "failed", "allocated=1, but should be 2")
    results.record("memory/b", "memory", "passed")  # a teardown pass cannot hide the failure
    results.record("graph/c", "graph", "skipped", "capability absent: graph_capture")
    results.record("comm/d", "comm", "xfailed", "declared: gloo")
    meta = {
        "hookspec_version": 1,
        "versions": {"suite": "0", "ds-core": "0", "backend": "0", "torch": "t", "python": "p"},
        "backend": {"name": "x", "distribution": "d", "vendor_version": "", "capabilities": []},
        "device": {"type": "cpu", "count": 1, "name": "n", "total_memory_gib": 1.0},
        "options": {"tiers": ["basic"], "strict": False},
        "xfail": {"file": "", "stale": []},
    }
    report = rep.build(meta, results)
    assert report["conformant"] is False
    assert report["categories"]["memory"]["failures"] == [
        {"id": "memory/b", "reason": "allocated=1, but should be 2"}
    ]
    assert report["categories"]["graph"]["capability_absent"] == 1
    text = rep.markdown(report)
    assert "| memory | 1 | 0 (0) | 0 | 0 | 1 |" in text
    assert "| graph | 0 | 1 (1) | 0 | 0 | 0 |" in text
    assert "- `memory/b`: allocated=1, but should be 2" in text and "NOT conformant" in text


# --------------------------------------------------------------------------- coverage


def test_every_hook_spec_has_a_conformance_test() -> None:
    assert coverage.uncovered() == [], "hooks without a conformance test"
    assert coverage.unknown() == [], "tests naming hooks that do not exist"


def test_coverage_check_notices_a_new_hook() -> None:
    assert coverage.uncovered(["ds_device_count", "ds_teleport_tensor"]) == ["ds_teleport_tensor"]
