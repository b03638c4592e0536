"""Which conformance checks catch each broken backend: ``python -m tests.broken_backends``.

Runs the suite once per broken backend on its own category (``--also CAT`` adds categories,
``--all`` runs every one) and prints a Markdown table: the planted bug, whether its own
category caught it, the checks that failed there, and any other category that failed too.
Slow (one conformance run per backend); not part of CI.

``--suite DIR`` puts another copy of the ``ds_conformance`` package first on the path (e.g.
an older release, extracted with ``git archive``), to measure the kill rate of that suite on
the same backends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.broken_backends import BROKEN, install


def run(
    stem: str, suite: str | None, categories: list[str]
) -> tuple[dict[str, list[str]], float, str]:
    """(category -> failing test ids, seconds, problem) of one full run on ``stem``."""
    with tempfile.TemporaryDirectory(prefix=f"ds-mutant-{stem}-") as tmp:
        root = Path(tmp)
        name = install(root, stem)
        paths = ([suite] if suite else []) + [str(root), *sys.path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
        env.pop("DS_ACCELERATOR", None)
        start = time.monotonic()
        cmd = [sys.executable, "-m", "ds_core.cli", "conformance", "--backend", name]
        cmd += ["--report", str(root / "report")]
        cmd += [a for c in categories for a in ("--category", c)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - start
        path = root / "report" / "conformance.json"
        if not path.exists():
            return {}, seconds, f"no report (exit {proc.returncode}): {proc.stderr[-300:]}"
        report = json.loads(path.read_text())
        failing = {
            cat: [f["id"].split("/", 1)[1] for f in row["failures"]]
            for cat, row in report["categories"].items()
            if row["failed"]
        }
        return failing, seconds, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stems", nargs="*", help="broken backends to run (default: all)")
    parser.add_argument("--suite", help="a folder holding another ds_conformance package")
    parser.add_argument("--also", action="append", default=[], help="another category to run")
    parser.add_argument("--all", action="store_true", help="run every category")
    args = parser.parse_args(argv)
    stems = args.stems or sorted(BROKEN)
    print(
        "| broken backend | planted bug | category | caught there | failing checks there "
        "| other failing categories | s |"
    )
    print("|---|---|---|---|---|---|---:|")
    caught = 0
    for stem in stems:
        category, _, what = BROKEN[stem]
        categories = [] if args.all else sorted({category, *args.also})
        failing, seconds, problem = run(stem, args.suite, categories)
        own = failing.get(category, [])
        caught += bool(own)
        checks = ", ".join(f"`{t}`" for t in own[:6]) + (
            f" (+{len(own) - 6})" if len(own) > 6 else ""
        )
        others = ", ".join(sorted(set(failing) - {category})) or "none"
        print(
            f"| {stem} | {what} | {category} | {'yes' if own else 'NO'} | {checks or problem} "
            f"| {others} | {seconds:.0f} |",
            flush=True,
        )
    print(f"\ncaught in their own category: {caught}/{len(stems)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
