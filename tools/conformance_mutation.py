"""Mutation-test the conformance suite: mutate the CPU backend, run the suite, count the kills.

Mutants come from cosmic-ray's operators (``pip install cosmic-ray``), applied one at a time to
one file of a *copy* of ``ds_backend_cpu`` in a temporary directory put first on
``PYTHONPATH`` (the worktree's files are never written, so an interrupted run leaves nothing
mutated behind; the copy is removed in a ``finally``). Each mutant is run against the one
conformance category its code belongs to (``memory.py`` -> memory, ``graph.py`` -> graph,
``comm.py``/``shm*.py`` -> comm, ``plugin.py`` by its ``# ---- <section>`` headers, i.e. by
the ``ds_<group>_`` hooks there). Outcome per mutant: killed (the suite fails), survived (it
passes), timeout or crash (the suite could not run: no report; both count as killed and are
noted).

    python tools/conformance_mutation.py --list [--category memory]
    nice -n 19 python tools/conformance_mutation.py --per-category 8 --seed 17 \\
        --budget 900 --category memory --category graph --out mutation.md

Slow (one suite run per mutant); not part of CI. Mutations inside annotations are skipped
(they are never evaluated here: every module uses ``from __future__ import annotations``), as
are cosmic-ray's operators that need arguments or a planted exception class.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation_select as sel  # next to this file; tools/ is not a package
from forkserver import ForkServer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "backends" / "cpu" / "ds_backend_cpu"
#: the tracer of the coverage runs (its sitecustomize.py and pytest plugin)
TRACER = ROOT / "tools" / "mutation_trace"
#: coverage maps, one per category and environment, under the sources' digest
CACHE = ROOT / ".mutation-cache"
#: survivors shown equivalent: ``key<TAB>reason`` (conformance/MUTATION.md renders them)
EQUIVALENT = ROOT / "conformance" / "mutation-equivalent.tsv"

#: what every suite run imports, loaded once by the fork server (never the backend under
#: test: each run imports the mutated copy afresh)
PRELOAD = ("ds_conformance.plugin", "pytest", "torch", "ds_core")
#: file -> category; plugin.py is split by its section headers (see SECTIONS).
FILES: dict[str, str | None] = {
    "plugin.py": None,
    "memory.py": "memory",
    "graph.py": "graph",
    "comm.py": "comm",
    "shm.py": "comm",
    "shm_groups.py": "comm",
    "shm_segment.py": "comm",
    "shm_sync.py": "comm",
}
#: plugin.py section header word -> conformance category
SECTIONS = {
    "backend": "backend",
    "device": "device",
    "rng": "rng",
    "streams": "stream",
    "memory": "memory",
    "dtypes": "dtype",
    "graph": "graph",
    "comm": "comm",
    "ops": "op",
    "determinism": "determinism",
    "launcher": "launcher",
}
#: category -> the environments the suite runs in: a mutant surviving the first is run in the
#: next (killed if any fails). The CPU backend's comm has two paths the default run never
#: takes on one host: gloo (shared memory off) and the pure-Python wait flags.
VARIANTS: dict[str, list[dict[str, str]]] = {
    "comm": [{}, {"DS_CPU_SHM": "0"}, {"DS_CPU_SHM_SYNC": "python"}],
}
_SECTION_RE = re.compile(r"^# -{10,} (\w+)\s*$")
#: need arguments (VariableReplacer/Inserter) or a planted exception class (ExceptionReplacer)
_SKIPPED_OPERATORS = {"VariableReplacer", "VariableInserter", "ExceptionReplacer"}
_Point = tuple[int, int, bool]  # a mutation position: line, column, skipped


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str  # relative to the package
    operator: str  # cosmic-ray operator name
    occurrence: int  # cosmic-ray's occurrence index of that operator in that file
    line: int
    category: str
    key: str  # the ledger's (mutation_select.mutant_keys): edits outside its statement keep it

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.operator}#{self.occurrence}"


@functools.cache
def _operators() -> dict[str, object]:
    from cosmic_ray.operators.provider import OperatorProvider

    provider = OperatorProvider()
    return {n: provider[n]() for n in sorted(provider) if n not in _SKIPPED_OPERATORS}


def _skipped(node: object) -> bool:
    """In an annotation (never evaluated) or in an f-string (message text only)."""
    child, parent = node, getattr(node, "parent", None)
    if getattr(node, "type", "") == "fstring":
        return True
    while parent is not None:
        if parent.type == "fstring":
            return True
        kids = parent.children  # type: ignore[attr-defined]
        if parent.type == "annassign" and kids.index(child) == 1:  # type: ignore[attr-defined]
            return True
        if parent.type == "tfpdef" and kids.index(child) == 2:  # type: ignore[attr-defined]
            return True
        if parent.type in ("param", "funcdef") and getattr(parent, "annotation", None) is child:
            return True
        child, parent = parent, parent.parent  # type: ignore[attr-defined]
    return False


def _categories_by_line(file: str, source: str) -> list[str]:
    """The category of each line (index 0 = line 1)."""
    fixed = FILES[file]
    if fixed is not None:
        return [fixed] * (source.count("\n") + 1)
    current, out = "backend", []  # module header (imports, NAME) counts as backend
    for text in source.split("\n"):
        m = _SECTION_RE.match(text)
        if m:
            current = SECTIONS[m.group(1)]
        out.append(current)
    return out


def _collector() -> type:
    from cosmic_ray.ast import Visitor

    class Collect(Visitor):  # type: ignore[misc]
        """Record each operator's positions in cosmic-ray's walk order (= its occurrences)."""

        def __init__(self, ops: dict[str, object], found: dict[str, list[_Point]]) -> None:
            self.ops, self.found = ops, found

        def visit(self, node):  # type: ignore[no-untyped-def]
            skip: bool | None = None
            for name, op in self.ops.items():
                for start, _stop in op.mutation_positions(node):  # type: ignore[attr-defined]
                    if skip is None:
                        skip = _skipped(node)
                    self.found[name].append((start[0], start[1], skip))
            return node

    return Collect


def enumerate_mutants(package: Path = PACKAGE, files: Iterable[str] = FILES) -> list[Mutant]:
    """Every mutant of every file (or of ``files``), in a deterministic order."""
    from cosmic_ray.ast import get_ast

    collect, ops = _collector(), _operators()
    mutants: list[Mutant] = []
    for file in files:
        source = (package / file).read_text()
        cats = _categories_by_line(file, source)
        found: dict[str, list[_Point]] = {name: [] for name in ops}
        collect(ops, found).walk(get_ast(source))
        statements = sel.StatementKeys(source)
        for name, positions in found.items():
            keys = sel.mutant_keys(file, statements, name, [(ln, col) for ln, col, _ in positions])
            for occ, ((line, _col, skip), key) in enumerate(zip(positions, keys, strict=True)):
                if not skip:
                    mutants.append(Mutant(file, name, occ, line, cats[line - 1], key))
    return mutants


def mutated_source(mutant: Mutant, package: Path = PACKAGE) -> str | None:
    from cosmic_ray.mutating import mutate_code

    op = _operators()[mutant.operator]
    return mutate_code((package / mutant.file).read_text(), op, mutant.occurrence)


def describe(mutant: Mutant, package: Path = PACKAGE) -> str:
    """``original → mutated`` of the changed line(s)."""
    before = (package / mutant.file).read_text().splitlines()
    after_src = mutated_source(mutant, package)
    if after_src is None:
        return "(no change)"
    after = after_src.splitlines()
    old, new = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after).get_opcodes():
        if tag != "equal":
            old += [t for t in before[i1:i2] if t.strip() and not t.strip().startswith("#")]
            new += [t for t in after[j1:j2] if t.strip() and not t.strip().startswith("#")]
    return f"`{' / '.join(s.strip() for s in old)}` → `{' / '.join(s.strip() for s in new)}`"


def sample(mutants: list[Mutant], per_category: int, seed: int) -> list[Mutant]:
    """``per_category`` mutants of each category, drawn with ``seed`` (deterministic)."""
    out: list[Mutant] = []
    for cat in sorted({m.category for m in mutants}):
        pool = [m for m in mutants if m.category == cat]
        random.Random(f"{seed}-{cat}").shuffle(pool)
        out += sorted(pool[:per_category], key=lambda m: (m.file, m.line, m.id))
    return out


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | timeout | crash | unchanged
    seconds: float
    detail: str = ""

    @property
    def killed(self) -> bool:
        return self.status in ("killed", "timeout", "crash")


class MutantCopy:
    """A temporary copy of the backend package; :meth:`apply` writes one mutant into it."""

    def __init__(self, package: Path = PACKAGE) -> None:
        self.package = package
        self.root = Path(tempfile.mkdtemp(prefix="ds-mutation-"))
        self.copy = self.root / package.name
        shutil.copytree(package, self.copy, ignore=shutil.ignore_patterns("__pycache__"))

    def apply(self, mutant: Mutant | None) -> str | None:
        """Reset the copy to the original and apply ``mutant``; the mutated file's text."""
        for file in FILES:
            shutil.copyfile(self.package / file, self.copy / file)
        shutil.rmtree(self.copy / "__pycache__", ignore_errors=True)
        if mutant is None:
            return None
        text = mutated_source(mutant, self.package)
        if text is not None:
            (self.copy / mutant.file).write_text(text)
        return text

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> MutantCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _suite_env(root: Path, extra: dict[str, str] | None) -> dict[str, str]:
    paths = [str(root), *sys.path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), DS_ACCELERATOR="cpu")
    env.update(extra or {})
    return env


def _suite_command(category: str, report: Path, checks: list[str] | None) -> list[str]:
    """pytest on ``category``: the whole suite package, or only ``checks`` (pytest arguments)."""
    from ds_conformance.runner import pytest_args

    args = pytest_args("cpu", report, categories=[category], extra=["-x"])
    if checks is not None:
        at = args.index("--pyargs")
        args[at : at + 2] = checks
    return [sys.executable, "-m", "pytest", *args]


def run_suite(
    copy: MutantCopy,
    category: str,
    timeout: float,
    extra: dict[str, str] | None = None,
    checks: list[str] | None = None,
    server: ForkServer | None = None,
) -> tuple[str, float, str]:
    """(killed|survived|timeout|crash, seconds, detail) of one suite run on the copy
    (``checks``: only these pytest arguments; default: the category's whole suite; ``server``:
    forked from it rather than a new interpreter)."""
    report = copy.root / "report"
    shutil.rmtree(report, ignore_errors=True)
    cmd = _suite_command(category, report, checks)
    start = time.monotonic()
    if server is not None:
        log = copy.root / "pytest.log"
        code = server.run("pytest:main", cmd[3:], log, timeout, dict(extra or {}), cwd=copy.root)
        output = log.read_text(errors="replace") if log.exists() else ""
        if code is None:
            return "timeout", time.monotonic() - start, f"over {timeout:.0f} s"
    else:
        env = _suite_env(copy.root, extra)
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=copy.root
            )
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - start, f"over {timeout:.0f} s"
        code, output = proc.returncode, proc.stderr or proc.stdout
    seconds = time.monotonic() - start
    if code == 0:
        return "survived", seconds, ""
    path = report / "conformance.json"
    if not path.exists():
        tail = output.strip().splitlines()[-1:] or ["?"]
        return "crash", seconds, tail[0][:160]
    data = json.loads(path.read_text())
    failures = [f["id"] for row in data["categories"].values() for f in row["failures"]]
    return "killed", seconds, failures[0] if failures else f"exit {code}"


def _variant_key(category: str, extra: dict[str, str]) -> str:
    return " ".join([category, *(f"{k}={v}" for k, v in sorted(extra.items()))])


def _digest() -> str:
    """Of everything a coverage map depends on: the backend's and the suite's sources."""
    h = hashlib.sha256()
    for base in (PACKAGE, ROOT / "conformance" / "ds_conformance"):
        for path in sorted(base.glob("*.py")):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def coverage_map(category: str, extra: dict[str, str], cache: Path) -> sel.CoverageMap:
    """Which checks execute each backend line, from one traced run of the unmutated suite
    (cached in ``cache`` under the sources' digest). :raises SystemExit: when it fails."""
    name = _variant_key(category, extra).replace(" ", "_").replace("=", "-")
    path = cache / f"{name}-{_digest()}.json"
    if path.exists():
        return sel.CoverageMap.from_json(json.loads(path.read_text()))
    with MutantCopy() as copy:  # an unmutated copy: traces name files relative to it
        traces = copy.root / "traces"
        traces.mkdir()
        env = _suite_env(copy.root, extra)
        env["PYTHONPATH"] = os.pathsep.join([str(TRACER), env["PYTHONPATH"]])
        env.update(DS_MUT_TRACE_DIR=str(traces), DS_MUT_TRACE_PKG=str(copy.copy))
        cmd = [*_suite_command(category, copy.root / "report", None), "-p", "mutation_context"]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=copy.root)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise SystemExit(f"traced run of {name} fails unmutated:\n{tail}")
        result = sel.CoverageMap.from_traces(traces, seconds)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json()))
    print(f"coverage {name}: {len(result.items)} checks, {seconds:.1f} s (traced)", flush=True)
    return result


@functools.cache
def _source(file: str) -> str:
    return (PACKAGE / file).read_text()


def _record(m: Mutant, status: str, seconds: float, detail: str, checks: str) -> dict[str, object]:
    return {
        "key": m.key, "id": m.id, "category": m.category, "file": m.file, "line": m.line,
        "operator": m.operator, "occurrence": m.occurrence, "status": status,
        "seconds": round(seconds, 1), "detail": detail, "checks": checks,
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip


def run(
    mutants: list[Mutant],
    budget: float,
    max_variants: int = 0,
    select: str = "coverage",
    ledger: Path | None = None,
    cache: Path = CACHE,
    fork: bool = False,
    retry: tuple[str, ...] = (),
) -> tuple[list[Outcome], list[Mutant], dict[str, float]]:
    """Run each mutant not yet in ``ledger`` (appending each outcome there); (outcomes, not
    run, baselines). ``select="coverage"`` runs a mutant only against the checks executing
    its statement (:mod:`mutation_select`); ``"full"`` against its category's whole suite.
    ``fork``: each mutant's runs fork from a server (tools/forkserver.py). ``retry``: ledger
    outcomes run again (``timeout``: those of a loaded host)."""
    outcomes: list[Outcome] = []
    baselines: dict[str, float] = {}
    maps: dict[str, sel.CoverageMap] = {}
    done = sel.read_ledger(ledger) if ledger else {}
    deadline = time.monotonic() + budget
    done = {k: r for k, r in done.items() if r["status"] not in retry}
    pending = [m for m in mutants if m.key not in done]
    with contextlib.ExitStack() as stack:
        copy = stack.enter_context(MutantCopy())
        server = (
            ForkServer(PRELOAD, _suite_env(copy.root, None), forbid=["ds_backend_"])
            if fork and pending
            else None
        )
        if server is not None:
            stack.callback(server.close)
        while pending and time.monotonic() < deadline:
            m = pending.pop(0)
            variants = VARIANTS.get(m.category, [{}])[: max_variants or None]
            for extra in variants:
                key = _variant_key(m.category, extra)
                if key in baselines:
                    continue
                if select == "coverage":
                    maps[key] = coverage_map(m.category, extra, cache)
                    baselines[key] = maps[key].seconds
                    continue
                copy.apply(None)
                status, secs, detail = run_suite(copy, m.category, 600, extra)
                if status != "survived":
                    raise SystemExit(f"baseline {key} fails unmutated: {status} {detail}")
                baselines[key] = secs
                print(f"baseline {key}: passes in {secs:.1f} s", flush=True)
            text = copy.apply(m)
            status, total, detail, ran = "survived", 0.0, sel.NOT_COVERED, []
            if text is None:
                status, detail = "unchanged", ""
            else:
                try:
                    compile(text, m.file, "exec")
                except SyntaxError as exc:
                    status, detail = "crash", f"SyntaxError: {exc.msg}"
                    variants = []
            span = sel.statement_spans(_source(m.file)).get(m.line, (m.line, m.line))
            for extra in variants if status == "survived" else []:
                key = _variant_key(m.category, extra)
                checks = maps[key].checks(m.file, span) if select == "coverage" else None
                if checks == []:
                    continue  # this environment's run never executes the statement
                ran.append("all" if checks is None else str(len(checks)))
                # three times the suite's time; a traced run (coverage) takes about twice it
                factor = 1.5 if select == "coverage" else 3.0
                full = timeout = max(60.0, factor * baselines[key] + 30)
                if checks is not None:  # a hung collective should not cost the whole suite's
                    share = len(checks) / max(1, len(maps[key].items))
                    timeout = min(full, 90 + factor * baselines[key] * share)
                status, secs, detail = run_suite(copy, m.category, timeout, extra, checks, server)
                total += secs
                if status == "survived" and checks is not None:  # confirm on the whole suite
                    ran[-1] += "+all"
                    status, secs, detail = run_suite(copy, m.category, full, extra, None, server)
                    total += secs
                if status != "survived":
                    if extra:
                        detail = f"{detail} [{key}]"
                    break
            outcomes.append(Outcome(m, status, total, detail))
            if ledger:
                sel.append_ledger(ledger, _record(m, status, total, detail, "+".join(ran) or "0"))
            print(
                f"{status:9} {total:6.1f} s  {m.category:12} {m.id}  checks {'+'.join(ran) or 0}"
                f"  {detail}",
                flush=True,
            )
        copy.apply(None)
        return outcomes, pending, baselines


def markdown(outcomes: list[Outcome], not_run: list[Mutant], totals: dict[str, int]) -> str:
    lines = [
        "| category | mutants (of) | killed | survived | timeout/crash (killed) | kill rate |",
        "|---|---|---|---|---|---|",
    ]
    cats = sorted({o.mutant.category for o in outcomes})
    all_run = all_killed = 0
    for cat in cats:
        rows = [o for o in outcomes if o.mutant.category == cat and o.status != "unchanged"]
        killed = sum(o.killed for o in rows)
        odd = sum(o.status in ("timeout", "crash") for o in rows)
        all_run, all_killed = all_run + len(rows), all_killed + killed
        rate = f"{100 * killed / len(rows):.0f}%" if rows else "–"
        lines.append(
            f"| {cat} | {len(rows)} ({totals.get(cat, 0)}) | {killed} | {len(rows) - killed} "
            f"| {odd} | {rate} |"
        )
    if all_run:
        lines.append(
            f"| **all** | **{all_run}** | **{all_killed}** | **{all_run - all_killed}** | "
            f"| **{100 * all_killed / all_run:.0f}%** |"
        )
    survivors = [o for o in outcomes if o.status == "survived"]
    lines += ["", "Survivors:", ""]
    lines += [f"- {o.mutant.category}: `{o.mutant.id}` {describe(o.mutant)}" for o in survivors]
    if not survivors:
        lines.append("- none")
    noted = [o for o in outcomes if o.status in ("timeout", "crash")]
    if noted:
        lines += ["", "Timeouts and crashes (counted as killed):", ""]
        lines += [f"- `{o.mutant.id}` {o.status}: {o.detail}" for o in noted]
    if not_run:
        lines += ["", f"Not run (budget spent): {len(not_run)} sampled mutants."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--category", action="append", default=[], help="only this category")
    parser.add_argument("--per-category", type=int, default=5, help="mutants sampled per category")
    parser.add_argument("--seed", type=int, default=17, help="sampling seed")
    parser.add_argument("--budget", type=float, default=1800, help="seconds; then stop")
    parser.add_argument("--list", action="store_true", help="print the sample, run nothing")
    parser.add_argument("--all", action="store_true", help="every mutant, not a sample")
    parser.add_argument("--mutant", action="append", default=[], help="only this id or key")
    parser.add_argument(
        "--variants", type=int, default=1, help="at most this many environments (0: all)"
    )
    parser.add_argument(
        "--select",
        choices=("coverage", "full"),
        default="coverage",
        help="run a mutant against the checks executing it (default) or the whole category",
    )
    parser.add_argument(
        "--resume", type=Path, help="ledger (JSON lines): skip the mutants it holds, append"
    )
    parser.add_argument(
        "--retry",
        action="append",
        default=[],
        choices=("timeout", "crash", "survived", "killed"),
        help="run again the --resume ledger's mutants with this outcome",
    )
    parser.add_argument(
        "--summary", action="store_true", help="print the --resume ledger's table; run nothing"
    )
    parser.add_argument("--equivalent", type=Path, default=EQUIVALENT, help="key<TAB>reason file")
    parser.add_argument("--cache", type=Path, default=CACHE, help="coverage maps' folder")
    parser.add_argument(
        "--shuffle", type=int, metavar="SEED", help="within a category, a seeded random order"
    )
    parser.add_argument(
        "--no-fork", action="store_true", help="a new interpreter for every suite run"
    )
    parser.add_argument("--out", help="also write the Markdown report here")
    args = parser.parse_args(argv)

    mutants = enumerate_mutants()
    if args.category:
        mutants = [m for m in mutants if m.category in args.category]
    totals: dict[str, int] = {}
    for m in mutants:
        totals[m.category] = totals.get(m.category, 0) + 1
    if args.summary:
        if not args.resume:
            parser.error("--summary reads the ledger named by --resume FILE")
        keys = {m.key for m in mutants}
        records = [r for k, r in sel.read_ledger(args.resume).items() if k in keys]
        equivalent = sel.read_equivalent(args.equivalent)
        print(sel.summary(records, totals, equivalent))
        by_key = {m.key: m for m in mutants}  # a record's line may be older: sort by now
        records.sort(key=lambda r: (r["category"], r["file"], by_key[r["key"]].line, r["key"]))
        for r in records:
            if r["status"] == "survived":
                why = equivalent.get(r["key"], "**open**" + (", not covered" * bool(r["detail"])))
                print(f"- {r['category']} `{r['key']}` {describe(by_key[r['key']])}: {why}")
        return 0
    chosen = mutants if args.all else sample(mutants, args.per_category, args.seed)
    if args.mutant:
        chosen = [m for m in mutants if m.id in args.mutant or m.key in args.mutant]
    # small categories first: a budget then finishes whole categories before starting comm
    chosen.sort(key=lambda m: (totals[m.category], m.category, m.file, m.line, m.id))
    if args.shuffle is not None:  # a partial run of a large category is then a fair sample
        order = {m.key: random.Random(f"{args.shuffle}-{m.key}").random() for m in chosen}
        chosen.sort(key=lambda m: (totals[m.category], m.category, order[m.key]))
    if args.list:
        for m in chosen:
            print(f"{m.category:12} {m.key:70} {describe(m)}")
        print(
            f"{len(chosen)} listed of {len(mutants)}: "
            + ", ".join(f"{c} {n}" for c, n in sorted(totals.items()))
        )
        return 0
    start = time.monotonic()
    outcomes, not_run, _baselines = run(
        chosen,
        args.budget,
        args.variants,
        args.select,
        args.resume,
        args.cache,
        not args.no_fork,
        tuple(args.retry),
    )
    text = markdown(outcomes, not_run, totals)
    print(text + f"\nwall time {time.monotonic() - start:.0f} s")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
