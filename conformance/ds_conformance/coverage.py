"""Which promises of the contract the suite's checks read: hook level and sentence level.

Hook level: every hook spec is named by some test's ``ds_hooks`` mark.

Sentence level (issue 28 §1): every sentence of every hook spec docstring, and of every spec
module docstring (rules for a group of hooks, addressed by the category name, e.g. ``"comm"``
for ``ds_core/hookspecs/comm.py``, and ``"hookspecs"`` for the rules shared by every hook), is
either linked to a check by a ``ds_promise(owner, fragment)`` mark, or classed in the spec as
untestable / promising nothing (:mod:`ds_core.hookspecs._contract`), or *uncovered*. A mark or
a spec entry whose fragment is in no sentence, or in more than one, of its owner is *stale*.

Splitting, done once here (:func:`sentences`): the docstring is cleaned
(``inspect.cleandoc``) and cut into units at blank lines, at each field line (``:param x:``,
``:returns:``, ``:raises X:``) and at each bullet (``- ``); a unit's lines are joined with
single spaces. A unit is cut after ``.``, ``!`` or ``?`` followed by a space and an upper-case
letter, a code span or an opening parenthesis, except inside code spans (backticks) and after
the abbreviations of :data:`ABBREVIATIONS`. Nothing is dropped: a sentence is its verbatim
text (whitespace-normalised), field labels included.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import ds_conformance

#: Abbreviations whose full stop ends no sentence.
ABBREVIATIONS: tuple[str, ...] = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")

#: The owner name of the package docstring of ``ds_core.hookspecs`` (rules of every hook).
SHARED = "hookspecs"

_FIELD = re.compile(r"^:(param|returns?|raises|rtype|type)\b[^:]*:")
_BULLET = re.compile(r"^[-*] ")
_CODE = re.compile(r"``.+?``|:[a-z]+:`[^`]+`|`[^`]+`")
_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-Z\x00(])")
_HOLE = "\x00{}\x01"


# -- sentences --------------------------------------------------------------------------------


def _units(doc: str) -> Iterator[str]:
    unit: list[str] = []
    for raw in inspect.cleandoc(doc).splitlines():
        line = raw.strip()
        starts = bool(_FIELD.match(line) or _BULLET.match(line))
        # An unindented line after a field or bullet starts a paragraph of its own.
        ends_item = (
            bool(unit)
            and not raw.startswith(" ")
            and bool(_FIELD.match(unit[0]) or _BULLET.match(unit[0]))
        )
        if not line or starts or ends_item:
            if unit:
                yield " ".join(unit)
            unit = []
        if line:
            unit.append(line)
    if unit:
        yield " ".join(unit)


def _split(unit: str) -> list[str]:
    held: list[str] = []

    def hold(match: re.Match[str]) -> str:
        held.append(match.group(0))
        return _HOLE.format(len(held) - 1)

    text = _CODE.sub(hold, unit)
    for abbreviation in ABBREVIATIONS:
        if abbreviation in text:
            held.append(abbreviation)
            text = text.replace(abbreviation, _HOLE.format(len(held) - 1))
    pieces = [p.strip() for p in _BOUNDARY.split(text) if p.strip()]

    def restore(piece: str) -> str:
        while "\x00" in piece:
            piece = re.sub(r"\x00(\d+)\x01", lambda m: held[int(m.group(1))], piece)
        return piece

    return [restore(p) for p in pieces]


def normalise(text: str) -> str:
    """``text`` with every run of whitespace one space, stripped."""
    return " ".join(text.split())


def sentences(doc: str | None) -> list[str]:
    """The sentences of a docstring, in order (see the module docstring for the rules)."""
    if not doc:
        return []
    return [normalise(s) for unit in _units(doc) for s in _split(unit)]


def _spec_modules() -> tuple[ModuleType, tuple[ModuleType, ...]]:
    import ds_core.hookspecs as specs

    return specs, specs.SPEC_MODULES


def owners() -> dict[str, Any]:
    """Owner name -> its documented object: the shared rules, each spec module, each hook."""
    package, modules = _spec_modules()
    result: dict[str, Any] = {SHARED: package}
    for module in modules:
        result[module.__name__.rsplit(".", 1)[1]] = module
        for name in vars(module):
            if name.startswith("ds_") and callable(getattr(module, name)):
                result[name] = getattr(module, name)
    return result


def spec_sentences() -> dict[str, list[str]]:
    """Owner name -> the sentences of its docstring."""
    return {name: sentences(obj.__doc__) for name, obj in owners().items()}


# -- links ------------------------------------------------------------------------------------


def _test_functions() -> Iterator[tuple[str, Any]]:
    for info in pkgutil.iter_modules(ds_conformance.__path__):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"ds_conformance.{info.name}")
        # A module may declare the category its checks belong to (as the plugin reads it).
        declared = getattr(module, "CATEGORY", None)
        category = declared if isinstance(declared, str) and declared else info.name[5:]
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn):
                yield f"{category}/{name}", fn


def covered_hooks() -> dict[str, list[str]]:
    """Hook name -> ``category/test`` ids of the suite tests that declare it."""
    covered: dict[str, list[str]] = {}
    for check, fn in _test_functions():
        for mark in getattr(fn, "pytestmark", []):
            if mark.name == "ds_hooks":
                for hook in mark.args:
                    covered.setdefault(hook, []).append(check)
    return covered


def uncovered(hooks: Iterable[str] | None = None) -> list[str]:
    """Hooks (default: every hook spec of the installed ds_core) that no suite test declares."""
    if hooks is None:
        from ds_core.hookspecs import all_hook_names

        hooks = all_hook_names()
    covered = covered_hooks()
    return [h for h in hooks if h not in covered]


def unknown() -> list[str]:
    """Hook names declared by tests that are not hook specs (typos, removed hooks)."""
    from ds_core.hookspecs import all_hook_names

    known = set(all_hook_names())
    return sorted(h for h in covered_hooks() if h not in known)


def promise_links() -> list[tuple[str, str, str]]:
    """(check id, owner, fragment) of every ``ds_promise`` mark of the suite's tests."""
    return [
        (check, str(mark.args[0]), str(mark.args[1]))
        for check, fn in _test_functions()
        for mark in getattr(fn, "pytestmark", [])
        if mark.name == "ds_promise"
    ]


def unchecked_entries() -> list[tuple[str, str, str]]:
    """(owner, fragment, reason) of every sentence the spec classes as read by no check."""
    from ds_core.hookspecs._contract import check_reason, unchecked_of

    entries: list[tuple[str, str, str]] = []
    for name, obj in owners().items():
        if isinstance(obj, ModuleType):
            section: dict[str, str] = getattr(obj, "UNCHECKED_SECTION", {})
            for fragment, reason in section.items():
                check_reason(fragment, reason)
                entries.append((name, fragment, reason))
        else:
            entries += [(name, f, r) for f, r in unchecked_of(obj)]
    return entries


# -- the table --------------------------------------------------------------------------------


@dataclass
class Row:
    """One sentence: the checks linked to it, or the spec's reason none is."""

    owner: str
    sentence: str
    checks: list[str] = field(default_factory=list)
    reason: str | None = None

    @property
    def status(self) -> str:
        """``covered``, ``untestable`` (either kind of spec entry) or ``uncovered``."""
        if self.checks:
            return "covered"
        return "untestable" if self.reason else "uncovered"


@dataclass
class Coverage:
    """Every sentence's row, and the links and spec entries that point at no one sentence."""

    rows: list[Row]
    stale: list[str]

    def count(self, status: str) -> int:
        """How many rows have ``status``."""
        return sum(1 for r in self.rows if r.status == status)

    def totals(self) -> dict[str, int]:
        """Sentences, covered, untestable, uncovered and stale links."""
        return {
            "sentences": len(self.rows),
            "covered": self.count("covered"),
            "untestable": self.count("untestable"),
            "uncovered": self.count("uncovered"),
            "stale": len(self.stale),
        }

    def uncovered(self) -> list[tuple[str, str]]:
        """(owner, sentence) of every uncovered sentence."""
        return [(r.owner, r.sentence) for r in self.rows if r.status == "uncovered"]


def _resolve(
    rows: dict[str, list[Row]], owner: str, fragment: str, what: str, stale: list[str]
) -> Row | None:
    if owner not in rows:
        stale.append(f"{what}: '{owner}' is no hook spec or spec section")
        return None
    wanted = normalise(fragment)
    found = [r for r in rows[owner] if wanted in r.sentence]
    if len(found) != 1:
        where = "no sentence" if not found else f"{len(found)} sentences"
        stale.append(f"{what}: {owner} {fragment!r} is in {where} of the docstring")
        return None
    return found[0]


def compute(
    specs: dict[str, list[str]] | None = None,
    links: list[tuple[str, str, str]] | None = None,
    entries: list[tuple[str, str, str]] | None = None,
) -> Coverage:
    """The coverage table (defaults: the installed spec, the suite's marks, the spec's entries).

    A sentence both linked to a check and classed untestable counts as covered, and the spec
    entry is reported stale (it contradicts the check).
    """
    specs = spec_sentences() if specs is None else specs
    links = promise_links() if links is None else links
    entries = unchecked_entries() if entries is None else entries
    rows = {o: [Row(o, s) for s in ss] for o, ss in specs.items()}
    stale: list[str] = []
    for check, owner, fragment in links:
        row = _resolve(rows, owner, fragment, check, stale)
        if row is not None and check not in row.checks:
            row.checks.append(check)
    for owner, fragment, reason in entries:
        row = _resolve(rows, owner, fragment, "spec entry", stale)
        if row is None:
            continue
        if row.reason is not None:
            stale.append(f"spec entry: {owner} {fragment!r} classes a sentence classed already")
        row.reason = reason
    for row in (r for rs in rows.values() for r in rs):
        if row.checks and row.reason:
            stale.append(
                f"spec entry: {row.owner} {row.sentence!r} is classed '{row.reason}' "
                f"but {', '.join(row.checks)} checks it"
            )
    return Coverage([r for rs in rows.values() for r in rs], stale)


def table(cov: Coverage) -> str:
    """The Markdown table (hook, sentence, checks) and the totals."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| hook | sentence | checks |", "|---|---|---|"]
    for row in cov.rows:
        if row.checks:
            checks = ", ".join(f"`{c}`" for c in row.checks)
        else:
            checks = row.reason or "**UNCOVERED**"
        lines.append(f"| {row.owner} | {cell(row.sentence)} | {cell(checks)} |")
    lines.append("")
    lines.append(", ".join(f"{k}: {v}" for k, v in cov.totals().items()))
    lines += [f"stale: {s}" for s in cov.stale]
    return "\n".join(lines)
