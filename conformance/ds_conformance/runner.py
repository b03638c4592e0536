"""``ds-core conformance``: run the suite through pytest and print the Markdown report."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest


def pytest_args(
    backend: str,
    report: Path,
    tiers: Sequence[str] = (),
    categories: Sequence[str] = (),
    strict: bool = False,
    xfail_file: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The pytest command line equivalent to a ``ds-core conformance`` call."""
    # The suite's own options only: the addopts of a project's pytest configuration found from
    # the working directory (this repository's runs tests in parallel processes, `-n 2`) would
    # change how the suite runs.
    args = ["-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rfE", "--pyargs", "ds_conformance"]
    args += ["--ds-backend", backend, "--ds-report", str(report), "--ds-no-summary"]
    args += [a for t in tiers for a in ("--ds-tier", t)]
    args += [a for c in categories for a in ("--ds-category", c)]
    if strict:
        args.append("--ds-strict")
    if xfail_file:
        args += ["--ds-xfail-file", xfail_file]
    return args + list(extra)


def run(
    backend: str,
    report: str | None = None,
    tiers: Sequence[str] = (),
    categories: Sequence[str] = (),
    strict: bool = False,
    xfail_file: str | None = None,
    extra: Sequence[str] = (),
) -> int:
    """Run the suite on ``backend``; print the Markdown report last.

    :returns: 0 when every test passed, was skipped for an absent capability or failed as
        declared; 1 on any failure; pytest's code (2-4) on a usage or internal error.
    """
    with tempfile.TemporaryDirectory(prefix="ds-conformance-") as tmp:
        directory = Path(report) if report else Path(tmp)
        code = pytest.main(
            pytest_args(backend, directory, tiers, categories, strict, xfail_file, extra)
        )
        markdown = directory / "conformance.md"
        if markdown.exists():
            print("\n" + markdown.read_text(), end="")
            if report:
                print(f"\nreports: {directory / 'conformance.json'}, {markdown}")
    if code == pytest.ExitCode.OK:
        return 0
    if code in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        return 1
    print(f"pytest stopped with exit code {int(code)}", file=sys.stderr)
    return int(code)


def coverage() -> int:
    """Print the sentence coverage table and totals (:mod:`ds_conformance.coverage`).

    :returns: 0 when every sentence is covered or classed in the spec and no link is stale;
        1 otherwise (the uncovered sentences and stale links are listed last, on stderr too).
    """
    from ds_conformance import coverage as cov

    result = cov.compute()
    print(cov.table(result))
    problems = [f"uncovered: {o}: {s}" for o, s in result.uncovered()]
    problems += [f"stale link: {s}" for s in result.stale]
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0
