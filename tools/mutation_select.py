"""Ledger and test selection of the mutation tool (``tools/conformance_mutation.py``).

The ledger is a JSON-lines file, one record per mutant run, keyed by :func:`mutant_keys` (file,
enclosing function or class, operator, occurrence within the statement and a hash of the
statement's text), so a later run skips what a ledger already holds, an edit elsewhere in the
file keeps a mutant's key, and a mutant whose statement changed is run again. Selection: a category's suite
runs once with every line of the backend traced per check (``tools/mutation_trace``); a mutant
then runs only against the checks that execute its statement, and a mutant no check executes is
"survived, not covered" without a run.
"""

from __future__ import annotations

import ast
import copy
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


#: nodes a mutation point belongs to: statements and the clauses holding their own code
_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _own_text(node: ast.AST) -> str:
    """The statement's code without the statements it holds (a compound one's header: `if …:`,
    decorators and `def …(…):`), normalised by :func:`ast.unparse`: formatting and comments
    do not count."""
    shallow = copy.copy(node)
    for name, value in ast.iter_fields(node):
        if isinstance(value, list) and value and isinstance(value[0], _STATEMENTS):
            setattr(shallow, name, [])
    return ast.unparse(shallow)


class StatementKeys:
    """Names each statement of one module by what survives edits elsewhere in the file:
    ``scope:digest`` where scope is the enclosing function or class (dotted, ``<module>`` at
    the top; a ``def``/``class`` statement itself is named by its own) and digest a hash of the
    statement's own text, with ``~n`` added for the n-th repeat of the same text in that scope.
    Lines inserted, removed or changed outside the statement (above it, in another function,
    in another statement of the same function) leave its name as it was; an edit of the
    statement itself changes it."""

    def __init__(self, source: str) -> None:
        self._lines = source.splitlines()
        #: (start, end, depth, name): positions as (line, character column)
        self._spans: list[tuple[tuple[int, int], tuple[int, int], int, str]] = []
        seen: dict[str, int] = {}

        def visit(node: ast.AST, scope: list[str], depth: int) -> None:
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, _STATEMENTS):
                    if isinstance(child, _DEFINITIONS):
                        inner = [*scope, child.name]
                    digest = hashlib.sha256(_own_text(child).encode()).hexdigest()[:10]
                    name = f"{'.'.join(inner) or '<module>'}:{digest}"
                    n = seen.get(name, 0)
                    seen[name] = n + 1
                    starts = [(child.lineno, self._column(child.lineno, child.col_offset))]
                    for d in getattr(child, "decorator_list", []):  # ast starts after its `@`
                        starts.append((d.lineno, self._column(d.lineno, d.col_offset) - 1))
                    start = min(starts)
                    end_line = child.end_lineno or child.lineno
                    end = (end_line, self._column(end_line, child.end_col_offset or 0))
                    self._spans.append((start, end, depth, f"{name}~{n}" if n else name))
                visit(child, inner, depth + 1)

        visit(ast.parse(source), [], 0)

    def _column(self, line: int, byte_offset: int) -> int:
        """ast's UTF-8 byte offset -> the character column (cosmic-ray/parso count characters)."""
        text = self._lines[line - 1] if 0 < line <= len(self._lines) else ""
        return len(text.encode()[:byte_offset].decode(errors="ignore"))

    def name(self, line: int, column: int) -> str:
        """The innermost statement holding the position (1-based line, 0-based character
        column). :raises ValueError: when no statement holds it."""
        best: tuple[int, str] | None = None
        for start, end, depth, name in self._spans:
            if start <= (line, column) < end and (best is None or depth > best[0]):
                best = (depth, name)
        if best is None:
            raise ValueError(f"no statement holds line {line}, column {column}")
        return best[1]


def mutant_keys(
    file: str, statements: StatementKeys, operator: str, points: Iterable[tuple[int, int]]
) -> list[str]:
    """The ledger key of each of ``operator``'s mutation points ``(line, column)`` in
    ``file``, given in cosmic-ray's walk order: ``file:scope:operator#k:digest``
    (:class:`StatementKeys`; ``k``: the point's index among the operator's points in the same
    statement, so a point added to another statement leaves it as it was)."""
    counts: dict[str, int] = {}
    keys = []
    for line, column in points:
        scope, _, digest = statements.name(line, column).rpartition(":")
        k = counts[scope + digest] = counts.get(scope + digest, -1) + 1
        keys.append(f"{file}:{scope}:{operator}#{k}:{digest}")
    return keys


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
