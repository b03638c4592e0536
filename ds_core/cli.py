"""The ``ds-core`` command: ``report``, and the subcommands other modules register.

``ds-core report [--json]`` describes the installation without creating a device context:
versions, every known and installed backend with its probe result, the backend that would be
selected, its capabilities, comm backend, memory and the limit capping it, and op providers.
It exits non-zero, saying why, on a broken installation.

Exit status of every subcommand: 0 success, 1 a failure, 2 a usage error (a bad flag, a path
that cannot be written). A user mistake is one ``ds-core <command>: error: ...`` line on
stderr, never a traceback; ``ds-core --debug <command>`` shows the traceback too.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ds_core.accelerator import build_accelerator
from ds_core.checkpoint import cli as checkpoint_cli
from ds_core.errors import DSCoreError
from ds_core.hookspecs import HOOKSPEC_VERSION
from ds_core.io import io_status
from ds_core.known_backends import KNOWN_BACKENDS, install_hint
from ds_core.plugins import BACKEND_GROUP, ENV_ACCELERATOR, choose, discover
from ds_core.scaffold import write_backend

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def collect_report() -> tuple[dict[str, Any], list[str]]:
    """Build the report as a JSON-able dict, and the list of problems that make it fail."""
    problems: list[str] = []
    report: dict[str, Any] = {
        "versions": {
            "ds-core": _version("ds-core"),
            "torch": _version("torch"),
            "python": platform.python_version(),
            "hookspec": HOOKSPEC_VERSION,
        },
        "backends": [],
        "selected": None,
    }
    try:
        entries = discover()
    except DSCoreError as exc:
        problems.append(str(exc))
        entries = {}
    for name in sorted(set(KNOWN_BACKENDS) | set(entries)):
        entry = entries.get(name)
        row: dict[str, Any] = {"name": name}
        if entry is None:
            row.update(
                installed=False, available=False, reason=f"not installed; {install_hint(name)}"
            )
        else:
            probe = entry.probe()
            row.update(
                installed=True,
                distribution=entry.distribution,
                version=entry.version,
                available=probe.available,
                reason=probe.reason,
                device_count=probe.device_count,
            )
            if entry.load_error:
                problems.append(f"backend {entry.describe()} failed to import: {entry.load_error}")
        report["backends"].append(row)

    requested = os.environ.get(ENV_ACCELERATOR) or None
    try:
        entry = choose(requested, entries)
        acc = build_accelerator(entry)
    except DSCoreError as exc:
        report["selection_error"] = str(exc)
        problems.append("no backend could be selected (see 'selected' above for why)")
        return report, problems
    # Capabilities, comm name and limits are cold queries; none creates a device context on
    # the cpu backend, and vendor backends answer them from the probe's management queries.
    mem = acc.memory_info()
    ops = []
    for provider in acc.op_providers():
        ok, why = provider.is_compatible()
        status = getattr(provider, "status", None)
        ops.append(
            {
                "name": provider.name,
                "compatible": ok,
                "reason": why,
                "status": str(status()) if callable(status) else "",
            }
        )
    report["selected"] = {
        "name": acc.name,
        "how": f"{ENV_ACCELERATOR}={requested}"
        if requested
        else "auto (highest priority available)",
        "device_type": acc.device_type,
        "device_count": acc.device_count(),
        "capabilities": sorted(acc.capabilities),
        "communication_backend": acc.communication_backend_name(),
        "memory": {
            "total_bytes": mem.total,
            "available_bytes": mem.available,
            "limit_bytes": mem.limit,
            "limit_source": mem.limit_source,
        },
        "op_providers": ops,
        "async_io": io_status(),
        "visible_devices_envs": acc.visible_devices_envs(),
        "export_env_prefixes": acc.export_envs(),
    }
    return report, problems


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def format_report(report: dict[str, Any]) -> str:
    lines = ["ds_core report", ""]
    for k, v in report["versions"].items():
        lines.append(f"  {k:<10} {v}")
    lines += ["", "backends:"]
    for b in report["backends"]:
        state = (
            "available"
            if b["available"]
            else ("installed, unavailable" if b["installed"] else "not installed")
        )
        lines.append(f"  {b['name']:<10} {state:<24} {b['reason']}")
    sel = report.get("selected")
    lines.append("")
    if sel is None:
        lines.append(f"selected: none\n  {report.get('selection_error', '')}")
        return "\n".join(lines)
    mem = sel["memory"]
    lines += [
        f"selected: {sel['name']} ({sel['how']})",
        f"  device type      {sel['device_type']} x {sel['device_count']}",
        f"  capabilities     {', '.join(sel['capabilities']) or 'none'}",
        f"  comm backend     {sel['communication_backend']}",
        f"  memory total     {_gib(mem['total_bytes'])}  available {_gib(mem['available_bytes'])}",
        f"  memory limit     {_gib(mem['limit_bytes'])} ({mem['limit_source'] or 'no process limit below the device capacity'})",
        f"  visible devices  {', '.join(sel['visible_devices_envs']) or '-'}",
        f"  async I/O        {sel.get('async_io', '-')}",
        "  op providers:",
    ]
    for op in sel["op_providers"] or [{"name": "none", "compatible": False, "reason": ""}]:
        mark = "compatible" if op["compatible"] else "incompatible"
        lines.append(f"    {op['name']:<14} {mark:<12} {op['reason']}")
        if op.get("status"):
            lines.append(f"    {'':<14} {'status':<12} {op['status']}")
    return "\n".join(lines)


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _report(args: argparse.Namespace) -> int:
    report, problems = collect_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    if problems:
        print("\nproblems:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    return 0


def _conformance_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run the conformance suite (pip install -e conformance, from a ds_core checkout) against "
        "an installed backend; print the Markdown report; exit non-zero on any failure. "
        "With --coverage, print which check reads each sentence of the hook specs instead."
    )
    p.add_argument("--backend", metavar="NAME", help="backend under test (required to run)")
    p.add_argument(
        "--coverage",
        action="store_true",
        help="print the table (hook, sentence, checks) and totals; run no test; exit 1 on an "
        "uncovered sentence or a stale link",
    )
    p.add_argument("--report", metavar="DIR", help="write conformance.json and conformance.md")
    p.add_argument(
        "--tier",
        action="append",
        choices=("basic", "multi-rank", "graph", "ops"),
        help="run only this tier (repeatable; default: all)",
    )
    p.add_argument(
        "--category", action="append", metavar="NAME", help="run only this hook category"
    )
    p.add_argument(
        "--strict", action="store_true", help="unexpected passes and stale xfails fail the run"
    )
    p.add_argument("--xfail-file", metavar="PATH", help="override the backend's xfail file")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: passed to pytest")


class UsageError(DSCoreError):
    """A subcommand's arguments are wrong (exit status 2)."""


def writable_folder(folder: str, flag: str) -> None:
    """Create ``folder`` and write a probe file in it: an unwritable output folder is an error
    before the work, not after it.

    :raises UsageError: naming the flag, the folder and why.
    """
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".ds-core-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"{flag} {folder}: cannot write there ({exc.strerror or exc}); choose a writable folder"
        ) from None


def _conformance(args: argparse.Namespace) -> int:
    import importlib

    if not args.coverage and not args.backend:
        raise UsageError("--backend NAME is required (or --coverage, which runs no test)")
    if args.report:  # before the suite runs: its results are not lost at the end
        writable_folder(args.report, "--report")
    try:
        # Imported by name: the suite is a separate distribution, absent from most installs.
        runner = importlib.import_module("ds_conformance.runner")
    except ImportError:
        print(
            "the conformance suite is not installed: pip install -e conformance (from a "
            "ds_core checkout; ds-core-conformance is not on the package index)",
            file=sys.stderr,
        )
        return 2
    if args.coverage:
        return int(runner.coverage())
    extra = [a for a in args.pytest_args if a != "--"]
    code: int = runner.run(
        args.backend,
        args.report,
        args.tier or (),
        args.category or (),
        args.strict,
        args.xfail_file,
        extra,
    )
    return code


def _new_backend_args(p: argparse.ArgumentParser) -> None:
    p.description = "Write a complete, installable backend package skeleton."
    p.add_argument("name", help="backend name (entry point name; lowercase, e.g. acme)")
    p.add_argument(
        "--device-type",
        default="cpu",
        help="torch device type the backend's tensors live on (default: cpu)",
    )
    p.add_argument(
        "--output",
        default=".",
        metavar="DIR",
        help="directory to create ds-core-NAME/ in (default: the current directory)",
    )


def taken_backend_name(name: str) -> str | None:
    """Why ``name`` cannot be a new backend's name (a backend ds_core knows, an installed
    backend entry point or an installed ``ds-core-<name>`` distribution: the package would
    replace or clash with it), or ``None``."""
    if name in KNOWN_BACKENDS:
        return f"'{name}' is the name of ds_core's {KNOWN_BACKENDS[name].vendor} backend"
    installed = {ep.name: ep for ep in md.entry_points(group=BACKEND_GROUP)}
    if name in installed:
        return f"a backend named '{name}' is installed ({installed[name].value})"
    dist = f"ds-core-{name.replace('_', '-')}"
    if _version(dist) != "not installed":
        return f"the distribution {dist} is installed"
    return None


def _new_backend(args: argparse.Namespace) -> int:
    taken = taken_backend_name(args.name)
    if taken is not None:
        raise UsageError(f"{taken}; choose another name")
    writable_folder(args.output, "--output")
    try:
        root = write_backend(args.name, args.device_type, args.output)
    except (ValueError, FileExistsError) as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {root}\nnext: pip install -e {root} && ds-core conformance --backend {args.name}")
    return 0


#: subcommand -> its one line in ``ds-core --help``
HELP = {
    "report": "describe the installation: versions, backends, the selected one (no device used)",
    "conformance": "run the conformance suite against an installed backend",
    "new-backend": "write an installable backend package skeleton (ds-core-NAME/)",
    "checkpoint": "inspect, convert and export checkpoints",
}


#: subcommand -> (add arguments, run). Other modules add theirs in :func:`_commands`.
def _commands() -> dict[str, Command]:
    commands: dict[str, Command] = {
        "report": (_report_args, _report),
        "conformance": (_conformance_args, _conformance),
        "new-backend": (_new_backend_args, _new_backend),
        "checkpoint": (checkpoint_cli.add_args, checkpoint_cli.run),
    }
    return commands


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-core",
        description="ds_core's command line: describe the installation, test and scaffold "
        "backends, handle checkpoints. Exit status: 0 success, 1 failure, 2 usage error.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (for a bug report)"
    )
    parser.add_argument("--version", action="version", version=f"ds-core {_version('ds-core')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands = _commands()
    for name, (add_args, _run) in commands.items():
        line = HELP.get(name, "")
        add_args(sub.add_parser(name, help=line, description=line))
    args = parser.parse_args(argv)
    try:
        return commands[args.command][1](args)
    except (DSCoreError, OSError) as exc:
        # A user's mistake or the environment's (a backend that fails, a full disk): one
        # line. Anything else is a bug in ds_core and keeps its traceback.
        if args.debug:
            traceback.print_exc()
        print(f"ds-core {args.command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
