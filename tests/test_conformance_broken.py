"""The conformance suite catches each deliberately broken backend, in the right category.

Each broken backend (tests/broken_backends) is installed as a real distribution in a
temporary directory and the suite runs on its one category through ``ds-core conformance``,
as a vendor would run it, narrowed to the checks the test asserts on (``NARROW``); the JSON
report must show the failures that catch the fault, in that category alone, and the checks
that must pass passing. The broken backends' runs are forked from one interpreter that has
imported torch and ds_core (tools/forkserver.py: two thirds of a fresh run's CPU time was
those imports), and their rank groups from multiprocessing's fork server
(``DS_CONFORMANCE_RANK_START=forkserver``, ds_conformance/ranks.py: a fresh interpreter per
rank was most of a comm case's CPU time); the other cases here run the CLI in a fresh
interpreter with fresh rank interpreters, as a vendor's run does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_conformance import ranks
from ds_conformance.comm_cases import cases

from tests.broken_backends import ALSO_FAILS, BROKEN, ENV, MUST_PASS, NARROW, install
from tests.distfactory import make_backend

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("forkserver", ROOT / "tools/forkserver.py")
assert _spec is not None and _spec.loader is not None
forkserver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forkserver)
#: what every CLI run imports, loaded once by the server (none selects a backend at import)
PRELOAD = ("torch", "pytest", "ds_core.cli", "ds_conformance.runner")


@pytest.fixture(scope="module")
def cli_forks() -> Iterator[Any]:
    forks = forkserver.ForkServer(PRELOAD, cwd=ROOT)
    yield forks
    forks.close()


def run_suite(
    site: Path,
    *args: str,
    timeout: float = 900,
    env_extra: dict[str, str] | None = None,
    forks: Any = None,
) -> tuple[int, str, dict[str, Any]]:
    """Run ``ds-core conformance`` with ``site`` on PYTHONPATH (and ``env_extra`` set), in a
    fresh interpreter or forked by ``forks``; return (code, output, report)."""
    report = site / "report"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]), **(env_extra or {}))
    env.pop("DS_ACCELERATOR", None)
    argv = ["conformance", "--report", str(report), *args]
    if forks is not None:
        log = site / "ds-core.out"
        code = forks.run("ds_core.cli:main", argv, log, timeout, env, replace_env=True, path=site)
        if code is None:
            raise subprocess.TimeoutExpired("ds-core conformance", timeout)
        output = log.read_text()
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "ds_core.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    path = report / "conformance.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    return code, output, data


def failing_categories(report: dict[str, Any]) -> set[str]:
    return {name for name, row in report["categories"].items() if row["failed"]}


def _may_unshare_mounts() -> bool:
    """Whether this process may make a private mount namespace, which the suite's cgroup
    check needs (as root, or with CAP_SYS_ADMIN); without it that check skips."""
    probe = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "os._exit(0 if libc.unshare(0x00020000) == 0 else 1)"
    )
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


@pytest.mark.parametrize("stem", sorted(BROKEN))
def test_broken_backend_fails_in_its_category(tmp_path: Path, stem: str, cli_forks: Any) -> None:
    category, must_fail, what = BROKEN[stem]
    if "cgroup" in stem and not _may_unshare_mounts():
        pytest.skip("the cgroup check needs a private mount namespace (root or CAP_SYS_ADMIN)")
    name = install(tmp_path, stem)
    extra = ("--", *NARROW[stem])
    code, output, report = run_suite(
        tmp_path,
        "--backend",
        name,
        "--category",
        category,
        *extra,
        env_extra={ranks.START_ENV: "forkserver", **ENV.get(stem, {})},
        forks=cli_forks,
    )
    assert code == 1, f"{stem} ({what}) was not caught: exit {code}\n{output[-3000:]}"
    assert report, f"no report written:\n{output[-3000:]}"
    assert failing_categories(report) == {category}, report["categories"]
    assert report["conformant"] is False
    assert report["backend"]["name"] == name
    assert "NOT conformant" in output
    failed = [f["id"] for f in report["categories"][category]["failures"]]
    assert f"{category}/{must_fail}" in failed, failed
    passed_too = [t for t in MUST_PASS.get(stem, ()) if f"{category}/{t}" in failed]
    assert not passed_too, f"{stem}: checks that must pass failed too: {passed_too}"
    also = [t for t in ALSO_FAILS.get(stem, ()) if f"{category}/{t}" not in failed]
    assert not also, f"{stem}: checks that must fail passed: {also}"


def test_absent_capability_is_skipped_and_conformant(tmp_path: Path) -> None:
    """A clone of the CPU backend that does not declare graph capture."""
    make_backend(
        tmp_path,
        "nograph",
        extra=(
            "\n@hookimpl\ndef ds_backend_capabilities():\n"
            "    return _cpu.ds_backend_capabilities() - {'graph_capture'}\n"
        ),
    )
    code, output, report = run_suite(tmp_path, "--backend", "nograph", "--category", "graph")
    assert code == 0, output[-3000:]
    row = report["categories"]["graph"]
    assert row["skipped"] == row["capability_absent"] > 0 and row["failed"] == 0
    assert "capability absent: graph_capture" in output


def test_stream_ordering_cases_run_where_async_streams_is_declared(tmp_path: Path) -> None:
    """A CPU clone declaring ``async_streams`` (its synchronous streams trivially honour the
    ordering): the stream-ordering cases run on its ranks and pass, instead of being skipped.
    What they prove on a real asynchronous device is in ds_conformance.comm_cases."""
    make_backend(
        tmp_path,
        "asyncclone",
        extra=(
            "\n@hookimpl\ndef ds_backend_capabilities():\n"
            "    return _cpu.ds_backend_capabilities() | {'async_streams'}\n"
        ),
    )
    code, output, report = run_suite(
        tmp_path, "--backend", "asyncclone", "--category", "comm", "--", "-k", "stream-"
    )
    assert code == 0, output[-3000:]
    row = report["categories"]["comm"]
    streams = [c for c in cases([torch.float32]) if c.variant.startswith("stream-")]
    assert len(streams) == 2 * 5  # two orderings of every collective
    assert row["passed"] == len(streams) and row["skipped"] == 0, row


def test_the_dead_peer_bound_defaults_to_30_s_and_refuses_a_bad_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound the broken receive is waited out for (``ENV``: 5 s) is a setting; unset, the
    suite waits the documented 30 s; anything but positive seconds is refused by name."""
    from ds_conformance import comm_dead_peer

    monkeypatch.delenv(comm_dead_peer.BOUND_ENV, raising=False)
    assert comm_dead_peer.bound_s() == 30.0
    monkeypatch.setenv(comm_dead_peer.BOUND_ENV, "2.5")
    assert comm_dead_peer.bound_s() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(comm_dead_peer.BOUND_ENV, bad)
        with pytest.raises(ValueError, match=rf"DS_CONFORMANCE_HANG_S='{bad}': expected a posit"):
            comm_dead_peer.bound_s()


def test_ranks_start_fresh_unless_the_fork_server_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vendor's run starts each rank in a fresh interpreter; the fork server is opt-in, and
    any other value is refused by name."""
    monkeypatch.delenv(ranks.START_ENV, raising=False)
    assert ranks.start_method() == "spawn"
    monkeypatch.setenv(ranks.START_ENV, "forkserver")
    assert ranks.start_method() == "forkserver"
    monkeypatch.setenv(ranks.START_ENV, "fork")
    with pytest.raises(ValueError, match="DS_CONFORMANCE_RANK_START='fork': expected 'spawn'"):
        ranks.start_method()
