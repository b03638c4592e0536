"""Results per hook category, written as JSON and Markdown for a vendor to publish."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTCOMES: tuple[str, ...] = ("passed", "skipped", "xfailed", "xpassed", "failed")
CAPABILITY_ABSENT = "capability absent"


@dataclass
class TestResult:
    """The final outcome of one test: a failure in any phase wins over a pass."""

    test_id: str
    category: str
    outcome: str
    reason: str = ""


@dataclass
class Results:
    """Every test's outcome, plus failures that belong to no test (stale xfail entries)."""

    tests: dict[str, TestResult] = field(default_factory=dict)

    def record(self, test_id: str, category: str, outcome: str, reason: str = "") -> None:
        previous = self.tests.get(test_id)
        if previous is not None and previous.outcome == "failed":
            return
        if previous is not None and outcome == "passed" and previous.outcome != "passed":
            return  # a teardown pass does not hide a skip or xfail from setup/call
        self.tests[test_id] = TestResult(test_id, category, outcome, reason)

    def by_category(self) -> dict[str, dict[str, Any]]:
        table: dict[str, dict[str, Any]] = {}
        for result in self.tests.values():
            row = table.setdefault(
                result.category,
                {**dict.fromkeys(OUTCOMES, 0), "capability_absent": 0, "failures": []},
            )
            row[result.outcome] += 1
            if result.outcome == "skipped" and result.reason.startswith(CAPABILITY_ABSENT):
                row["capability_absent"] += 1
            if result.outcome == "failed":
                row["failures"].append({"id": result.test_id, "reason": result.reason})
        return dict(sorted(table.items()))

    @property
    def failed(self) -> bool:
        return any(r.outcome == "failed" for r in self.tests.values())


def build(meta: dict[str, Any], results: Results) -> dict[str, Any]:
    """The JSON report: ``meta`` (versions, backend, device, options) plus results."""
    categories = results.by_category()
    totals = {o: sum(row[o] for row in categories.values()) for o in OUTCOMES}
    return {
        **meta,
        "conformant": not results.failed,
        "totals": totals,
        "categories": categories,
        "tests": [
            {"id": r.test_id, "category": r.category, "outcome": r.outcome, "reason": r.reason}
            for r in sorted(results.tests.values(), key=lambda r: r.test_id)
        ],
    }


def table(report: dict[str, Any]) -> str:
    """The per-category Markdown table, with a totals row."""
    lines = [
        "| category | passed | skipped (capability absent) | xfailed | xpassed | failed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["categories"].items():
        lines.append(
            f"| {name} | {row['passed']} | {row['skipped']} ({row['capability_absent']}) | "
            f"{row['xfailed']} | {row['xpassed']} | {row['failed']} |"
        )
    t = report["totals"]
    absent = sum(row["capability_absent"] for row in report["categories"].values())
    lines.append(
        f"| **total** | {t['passed']} | {t['skipped']} ({absent}) | {t['xfailed']} | "
        f"{t['xpassed']} | {t['failed']} |"
    )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """The whole Markdown report: header, table, failures, expected failures, skips."""
    b, v, d = report["backend"], report["versions"], report["device"]
    verdict = "**conformant**" if report["conformant"] else "**NOT conformant**"
    out = [
        f"# ds_core conformance: backend `{b['name']}` — {verdict}",
        "",
        f"- suite: ds-core-conformance {v['suite']} · HOOKSPEC_VERSION {report['hookspec_version']}",
        f"- versions: ds-core {v['ds-core']} · {b['distribution']} {v['backend']} · "
        f"torch {v['torch']} · python {v['python']} · vendor stack {b['vendor_version'] or '-'}",
        f"- device: {d['type']} × {d['count']}: {d['name']} ({d['total_memory_gib']:.1f} GiB)",
        f"- capabilities: {', '.join(b['capabilities']) or 'none'}",
        f"- tiers: {', '.join(report['options']['tiers'])} · strict: {report['options']['strict']}"
        f" · xfail file: {report['xfail']['file'] or 'none'}",
        "",
        table(report),
    ]
    failures = [f for row in report["categories"].values() for f in row["failures"]]
    if failures:
        out += ["", "## Failures", ""]
        out += [f"- `{f['id']}`: {f['reason']}" for f in failures]
    xfails = [t for t in report["tests"] if t["outcome"] in ("xfailed", "xpassed")]
    if xfails:
        out += ["", "## Expected failures (declared by the backend)", ""]
        out += [f"- `{t['id']}` ({t['outcome']}): {t['reason']}" for t in xfails]
    if report["xfail"]["stale"]:
        out += ["", "## Stale xfail entries (match no test)", ""]
        out += [f"- `{s}`" for s in report["xfail"]["stale"]]
    skips = sorted({t["reason"] for t in report["tests"] if t["outcome"] == "skipped"})
    if skips:
        out += ["", "## Skip reasons", ""]
        out += [f"- {s}" for s in skips]
    return "\n".join(out) + "\n"


def write(report: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    """Write ``conformance.json`` and ``conformance.md`` into ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "conformance.json"
    md_path = directory / "conformance.md"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path
