"""The pytest plugin (entry point ``pytest11``): selects the backend, filters, reports.

It does nothing unless ``--ds-backend NAME`` is given: it only registers its options and
markers. With a backend, it selects it as the process's accelerator (``DS_ACCELERATOR`` is
set too, so the ranks and subprocesses the tests start use it), prints a report header, skips
tests of capabilities the backend does not declare, applies the backend's xfail file, keeps
only the requested tiers and categories, and writes the JSON and Markdown reports.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import pytest

import ds_conformance
from ds_conformance import report as rep
from ds_conformance import xfail
from ds_conformance.marks import MARKER_LINES

_PACKAGE = "ds_conformance"
_STATE = pytest.StashKey["Suite"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds_conformance", "ds_core conformance suite")
    group.addoption("--ds-backend", metavar="NAME", help="backend under test (enables the suite)")
    group.addoption(
        "--ds-tier",
        action="append",
        choices=ds_conformance.TIERS,
        help="run only this tier (repeatable; default: all)",
    )
    group.addoption(
        "--ds-category",
        action="append",
        metavar="NAME",
        help="run only this hook category, e.g. memory (repeatable; default: all)",
    )
    group.addoption("--ds-report", metavar="DIR", help="write conformance.json and .md here")
    group.addoption(
        "--ds-strict",
        action="store_true",
        help="unexpected passes and stale xfail entries are failures",
    )
    group.addoption(
        "--ds-no-summary",
        action="store_true",
        help="do not print the table in pytest's summary (ds-core conformance prints it last)",
    )
    group.addoption(
        "--ds-xfail-file",
        metavar="PATH",
        help="expected failures (default: conformance-xfail.txt at the backend package root)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKER_LINES:
        config.addinivalue_line("markers", line)
    name = config.getoption("--ds-backend")
    if not name:
        return
    suite = Suite(config, name)
    config.stash[_STATE] = suite
    config.pluginmanager.register(suite, "ds_conformance_suite")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _STATE not in config.stash and any(_is_suite_item(i) for i in items):
        raise pytest.UsageError(
            "the ds_core conformance tests need a backend: pass --ds-backend NAME "
            "(or run `ds-core conformance --backend NAME`)"
        )


def suite_of(config: pytest.Config) -> Suite:
    """The running suite's state. :raises pytest.UsageError: without ``--ds-backend``."""
    if _STATE not in config.stash:
        raise pytest.UsageError("pass --ds-backend NAME to run the ds_core conformance tests")
    return config.stash[_STATE]


@pytest.fixture(scope="session")
def acc(request: pytest.FixtureRequest) -> Any:
    """The accelerator under test (the process's selected backend)."""
    return suite_of(request.config).acc


@pytest.fixture(scope="session")
def rank_groups(request: pytest.FixtureRequest) -> Any:
    """Rank processes shared by every multi-rank test of the run (:mod:`ds_conformance.ranks`)."""
    from ds_conformance.ranks import RankGroups

    suite_of(request.config)
    return RankGroups(request.session.items)


def _is_suite_item(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and module.__name__.startswith(_PACKAGE + ".test_")


def category_of(item: pytest.Item) -> str:
    """The hook category of a suite test: its module's ``CATEGORY`` (a module of checks that
    belong to a category but are kept apart from its main module, e.g. edge axes), else its
    module name without ``test_``."""
    return module_category(item.module)  # type: ignore[attr-defined]


def module_category(module: Any) -> str:
    """The category of a suite test module (see :func:`category_of`)."""
    declared = getattr(module, "CATEGORY", None)
    if isinstance(declared, str) and declared:
        return declared
    return str(module.__name__).rsplit(".", 1)[1].removeprefix("test_")


def test_id(item: pytest.Item) -> str:
    """The id used in reports and xfail files: ``category/test_name[params]``."""
    return f"{category_of(item)}/{item.name}"


def _one_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0].removeprefix("Failed: ")[:300] if lines else "failed"


class Suite:
    """State and hooks of one conformance run (registered only with ``--ds-backend``)."""

    def __init__(self, config: pytest.Config, name: str) -> None:
        from ds_core import get_accelerator, reset_accelerator, set_accelerator
        from ds_core.errors import DSCoreError

        self.config = config
        self.name = name
        self.tiers: list[str] = config.getoption("--ds-tier") or list(ds_conformance.TIERS)
        self.categories: list[str] | None = config.getoption("--ds-category")
        self.strict: bool = bool(config.getoption("--ds-strict"))
        self.results = rep.Results()
        self.ids: dict[str, tuple[str, str]] = {}  # nodeid -> (test id, category)
        self.stale: list[str] = []
        # The environment before this process selected (and so probed) the backend: children
        # that judge a probe's side effects start from it, not from what the probe left.
        self.env_at_start: dict[str, str] = dict(os.environ, DS_ACCELERATOR=name)
        os.environ["DS_ACCELERATOR"] = name  # ranks and subprocesses test the same backend
        reset_accelerator()
        set_accelerator(name)
        try:
            self.acc = get_accelerator()
        except DSCoreError as exc:
            raise pytest.UsageError(f"cannot test backend '{name}': {exc}") from exc
        given = config.getoption("--ds-xfail-file")
        self.xfail_path = Path(given) if given else xfail.backend_file(self.acc.entry.target)
        try:
            self.xfails = (
                xfail.parse(self.xfail_path.read_text(), str(self.xfail_path))
                if self.xfail_path is not None
                else []
            )
        except (OSError, ValueError) as exc:
            raise pytest.UsageError(f"cannot read the xfail file: {exc}") from exc

    # -- header ------------------------------------------------------------------------------

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        acc = self.acc
        env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("DS_"))
        return [
            f"ds_conformance {ds_conformance.__version__}: backend {acc.entry.describe()}, "
            f"device type {acc.device_type}, HOOKSPEC_VERSION {acc.info.hookspec_version}",
            f"capabilities: {', '.join(sorted(acc.capabilities)) or 'none'}",
            f"tiers: {', '.join(self.tiers)}; categories: "
            f"{', '.join(self.categories) if self.categories else 'all'}; "
            f"xfail file: {self.xfail_path or 'none'}; strict: {self.strict}",
            f"environment: {env}",
        ]

    # -- collection --------------------------------------------------------------------------

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        used: set[int] = set()
        keep: list[pytest.Item] = []
        dropped: list[pytest.Item] = []
        for item in items:
            if not _is_suite_item(item):
                keep.append(item)
                continue
            tid, category = test_id(item), category_of(item)
            self.ids[item.nodeid] = (tid, category)
            for n, entry in enumerate(self.xfails):
                if entry.matches(tid):
                    used.add(n)
                    item.add_marker(
                        pytest.mark.xfail(reason=f"declared: {entry.reason}", strict=self.strict)
                    )
                    break
            tier_mark = item.get_closest_marker("ds_tier")
            tier = tier_mark.args[0] if tier_mark else "basic"
            if tier not in self.tiers or (self.categories and category not in self.categories):
                dropped.append(item)
                continue
            for mark in item.iter_markers("ds_capability"):
                cap = mark.args[0]
                if cap not in self.acc.capabilities:
                    item.add_marker(pytest.mark.skip(reason=f"{rep.CAPABILITY_ABSENT}: {cap}"))
            keep.append(item)
        self.stale = [e.test_id for n, e in enumerate(self.xfails) if n not in used]
        for stale in self.stale:
            warnings.warn(
                f"{self.xfail_path}: xfail entry '{stale}' matches no conformance test",
                pytest.PytestWarning,
                stacklevel=1,
            )
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep

    # -- results -----------------------------------------------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        known = self.ids.get(report.nodeid)
        if known is None:
            return
        tid, category = known
        wasxfail = getattr(report, "wasxfail", None)
        if report.failed:
            reason = _one_line(report)
            if report.when != "call":
                reason = f"{report.when}: {reason}"
            self.results.record(tid, category, "failed", reason)
        elif report.skipped:
            if wasxfail is not None:
                self.results.record(tid, category, "xfailed", str(wasxfail))
            else:
                longrepr = report.longrepr
                reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
                self.results.record(tid, category, "skipped", reason.removeprefix("Skipped: "))
        elif report.when == "call":
            if wasxfail is not None:
                self.results.record(tid, category, "xpassed", str(wasxfail))
            else:
                self.results.record(tid, category, "passed")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.strict:
            for entry in self.stale:
                self.results.record(
                    f"xfail-file/{entry}", "xfail-file", "failed", "stale entry: matches no test"
                )
        self.report = rep.build(self._meta(), self.results)
        directory = self.config.getoption("--ds-report")
        if directory:
            rep.write(self.report, Path(directory))
        if self.results.failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        report = getattr(self, "report", None)
        if report is None or self.config.getoption("--ds-no-summary"):
            return
        terminalreporter.section(f"ds_core conformance: {self.name}")
        for line in rep.table(report).splitlines():
            terminalreporter.write_line(line)

    # -- report metadata ---------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        import torch

        from ds_core.hookspecs import HOOKSPEC_VERSION

        acc = self.acc
        props = acc.device_properties()
        return {
            "suite": "ds-core-conformance",
            "hookspec_version": HOOKSPEC_VERSION,
            "versions": {
                "suite": ds_conformance.__version__,
                "ds-core": _dist_version("ds-core"),
                "backend": acc.entry.version,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "backend": {
                "name": acc.name,
                "distribution": acc.entry.distribution,
                "device_type": acc.device_type,
                "description": acc.info.description,
                "vendor_version": acc.info.vendor_version,
                "targets_hookspec": acc.info.hookspec_version,
                "capabilities": sorted(acc.capabilities),
            },
            "device": {
                "type": acc.device_type,
                "count": acc.device_count(),
                "name": props.name,
                "total_memory_bytes": props.total_memory,
                "total_memory_gib": props.total_memory / 2**30,
                "host": f"{platform.system()} {platform.machine()}",
            },
            "options": {
                "tiers": self.tiers,
                "categories": self.categories or "all",
                "strict": self.strict,
            },
            "xfail": {"file": str(self.xfail_path or ""), "stale": self.stale},
        }


def _dist_version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"
