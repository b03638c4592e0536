"""Ledger and test selection of the mutation tool (``tools/conformance_mutation.py``).

The ledger is a JSON-lines file, one record per mutant run, keyed by :func:`mutant_key` (file,
line, operator, occurrence and a hash of the source line mutated), so a later run skips what a
ledger already holds and a mutant whose line changed is run again. Selection: a category's suite
runs once with every line of the backend traced per check (``tools/mutation_trace``); a mutant
then runs only against the checks that execute its statement, and a mutant no check executes is
"survived, not covered" without a run.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: outcomes that count as killed (the suite failed, could not run, or ran out of time)
KILLED = ("killed", "timeout", "crash")
NOT_COVERED = "not covered"


def mutant_key(file: str, line: int, operator: str, occurrence: int, source: str) -> str:
    """Stable id: ``file:line:operator#occurrence:hash`` (hash of the mutated line's text)."""
    text = source.splitlines()[line - 1].strip() if 0 < line <= source.count("\n") + 1 else ""
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{file}:{line}:{operator}#{occurrence}:{digest}"


def read_ledger(path: Path) -> dict[str, dict[str, Any]]:
    """key -> the last record of that key (a run may append a key again: the last one wins)."""
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:  # a run killed mid-write leaves a partial last line
            if n == len(path.read_text().splitlines()):
                continue
            raise SystemExit(
                f"{path}:{n}: not a JSON record ({exc.msg}); fix or remove the line"
            ) from None
        records[record["key"]] = record
    return records


def append_ledger(path: Path, record: dict[str, Any]) -> None:
    """Append one record and flush it to disk (an interrupted run keeps every finished mutant)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_equivalent(path: Path) -> dict[str, str]:
    """key -> why the mutant is equivalent (``key<TAB>reason`` lines, ``#`` comments)."""
    out: dict[str, str] = {}
    if path.exists():
        for text in path.read_text().splitlines():
            if text.strip() and not text.startswith("#"):
                key, _, reason = text.partition("\t")
                out[key.strip()] = reason.strip()
    return out


def statement_spans(source: str) -> dict[int, tuple[int, int]]:
    """line -> the lines of the innermost statement holding it (a compound one's header only)."""
    spans: dict[int, tuple[int, int]] = {}
    best: dict[int, int] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt):
            continue
        start, end = node.lineno, node.end_lineno or node.lineno
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            end = max(start, body[0].lineno - 1)  # the header: `if …:`, `def …(…):`
        for line in range(start, end + 1):
            if line not in best or end - start < best[line]:
                best[line], spans[line] = end - start, (start, end)
    return spans


@dataclasses.dataclass
class CoverageMap:
    """Which checks of one suite run execute each backend line."""

    lines: dict[str, dict[int, set[str]]]  # file -> line -> contexts ("" = every check)
    items: dict[str, dict[str, Any]]  # check id -> {"arg": pytest argument, "case": key|None}
    seconds: float = 0.0

    @classmethod
    def from_traces(cls, directory: Path, seconds: float) -> CoverageMap:
        """Read what the traced run wrote (``trace-*.tsv`` and ``items.json``)."""
        lines: dict[str, dict[int, set[str]]] = {}
        for trace in sorted(directory.glob("trace-*.tsv")):
            for text in trace.read_text().splitlines():
                parts = text.split("\t")
                if len(parts) != 3 or not parts[2].isdigit():
                    continue  # a process killed mid-write
                ctx, file, line = parts
                lines.setdefault(file, {}).setdefault(int(line), set()).add(ctx)
        items = json.loads((directory / "items.json").read_text())
        return cls(lines, items, seconds)

    def to_json(self) -> dict[str, Any]:
        lines = {f: {str(n): sorted(c) for n, c in ls.items()} for f, ls in self.lines.items()}
        return {"lines": lines, "items": self.items, "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CoverageMap:
        lines = {f: {int(n): set(c) for n, c in ls.items()} for f, ls in data["lines"].items()}
        return cls(lines, data["items"], data["seconds"])

    def checks(self, file: str, span: tuple[int, int]) -> list[str] | None:
        """The pytest arguments of the checks executing any line of ``span``: ``[]`` when
        nothing runs it, ``None`` when every check must run (it runs only outside the checks:
        at import, in a shared fixture; or in a context no collected check owns).

        Where checks run it, a run outside them (the session's accelerator probing every hook)
        is left out: the checks then decide. A survivor of such a selection is only a
        candidate; :func:`conformance_mutation.run` confirms it on the whole suite."""
        contexts: set[str] = set()
        for line in range(span[0], span[1] + 1):
            contexts |= self.lines.get(file, {}).get(line, set())
        if contexts - {""}:
            contexts.discard("")
        by_case: dict[str, list[str]] = {}
        for item in self.items.values():
            if item["case"] is not None:
                by_case.setdefault(item["case"], []).append(item["arg"])
        args: set[str] = set()
        for ctx in contexts:
            if ctx.startswith("case:") and ctx[5:] in by_case:
                args.update(by_case[ctx[5:]])
            elif ctx in self.items:
                args.add(self.items[ctx]["arg"])
            else:
                return None
        return sorted(args)


def summary(
    records: Iterable[dict[str, Any]], totals: dict[str, int], equivalent: dict[str, str]
) -> str:
    """Markdown: per category, enumerated / run / killed / survived / equivalent / not run."""
    rows = [
        "| category | mutants | run | killed (timeouts) | survived (not covered) | equivalent "
        "| not yet run | killed / non-equivalent |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_cat: dict[str, list[dict[str, Any]]] = {c: [] for c in totals}
    for r in records:
        by_cat.setdefault(r["category"], []).append(r)
    sums = [0] * 7
    for cat in sorted(by_cat, key=lambda c: (-totals.get(c, 0), c)):
        recs = [r for r in by_cat[cat] if r["status"] != "unchanged"]
        killed = sum(r["status"] in KILLED for r in recs)
        timeouts = sum(r["status"] == "timeout" for r in recs)
        surv = [r for r in recs if r["status"] == "survived"]
        eq = sum(r["key"] in equivalent for r in surv)
        uncovered = sum(r.get("detail") == NOT_COVERED for r in surv)
        left = totals.get(cat, 0) - len(by_cat[cat])
        denominator = len(recs) - eq
        rate = f"{killed}/{denominator} = {100 * killed / denominator:.1f}%" if denominator else "–"
        vals = [totals.get(cat, 0), len(recs), killed, len(surv), eq, left, denominator]
        sums = [a + b for a, b in zip(sums, vals, strict=True)]
        rows.append(
            f"| {cat} | {vals[0]} | {vals[1]} | {killed} ({timeouts}) | {len(surv)} ({uncovered}) | {eq} "
            f"| {left} | {rate} |"
        )
    rate = f"{sums[2]}/{sums[6]} = {100 * sums[2] / sums[6]:.1f}%" if sums[6] else "–"
    rows.append(
        f"| **all** | {sums[0]} | {sums[1]} | {sums[2]} | {sums[3]} | {sums[4]} | {sums[5]} "
        f"| {rate} |"
    )
    return "\n".join(rows) + "\n"
