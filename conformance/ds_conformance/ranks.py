"""Groups of rank processes shared by every multi-rank test of a run.

Spawning ranks and forming a process group costs seconds, so one group per world size runs
every multi-rank job the selected tests need (``comm``: every collective case; ``zero``: the
ZeRO smoke runs) and each test then reads its own result. Ranks are processes on the ``cpu``
device type; elsewhere a world size needs that many devices, else its tests skip.

Each rank is a fresh interpreter (``python -m ds_conformance._rank_worker``), as a vendor's
launcher would start it. ``DS_CONFORMANCE_RANK_START=forkserver`` instead forks the ranks from
one server that has imported :data:`FORKSERVER_PRELOAD` (multiprocessing's forkserver): the
server imports modules only (none selects a backend, reads ``DS_*`` settings or touches a
device at import), so every rank still initialises its backend and device after the fork.
It saves the per-rank start-up (about two CPU seconds of ``import torch``) for suites that
run the conformance suite many times, such as the project's broken-backend tests; unset, a
vendor's run is unchanged.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import pytest

# Seconds a whole group may take; a hung collective makes every result of the group fail.
GROUP_TIMEOUT = 600.0
#: test module -> the rank job it reads results from
JOB_OF_MODULE: dict[str, str] = {"test_comm": "comm", "test_zero": "zero"}
#: how rank processes start: "spawn" (a fresh interpreter each, the default) or "forkserver"
START_ENV = "DS_CONFORMANCE_RANK_START"
#: what the fork server imports before it forks ranks: modules only, none selects a backend
FORKSERVER_PRELOAD = ["torch", "ds_core", "ds_conformance._rank_worker"]


def start_method() -> str:
    """The rank start method ``DS_CONFORMANCE_RANK_START`` selects (default ``"spawn"``).

    :raises ValueError: a value other than ``spawn`` or ``forkserver``, naming the variable.
    """
    value = os.environ.get(START_ENV, "spawn").strip() or "spawn"
    if value not in ("spawn", "forkserver"):
        raise ValueError(f"{START_ENV}={value!r}: expected 'spawn' (the default) or 'forkserver'")
    return value


def _forked_rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """A rank forked by the fork server: the environment and output a fresh rank would have,
    then the worker's ``main`` with ``argv``."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["ds_conformance._rank_worker", *argv]
    from ds_conformance import _rank_worker

    code = _rank_worker.main()
    # an interpreter's exit: multiprocessing's children skip atexit, which a backend may use
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Forked:
    """A forked rank behind the :class:`subprocess.Popen` calls :func:`spawn_group` makes."""

    def __init__(self, ctx: Any, argv: list[str], env: dict[str, str], log: IO[str]) -> None:
        self._proc = ctx.Process(target=_forked_rank, args=(argv, env, log.name), daemon=False)
        self._proc.start()

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("ds_conformance._rank_worker", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        self._proc.kill()

    @property
    def returncode(self) -> int | None:
        code: int | None = self._proc.exitcode
        return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn_group(
    world: int,
    jobs: Iterable[str],
    cases: Iterable[str] | None = None,
    env_extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Run ``jobs`` on ``world`` ranks; return result key -> "" (pass) or the failure.

    :param cases: the case keys to run (default: every case of the world size).
    :param env_extra: variables set for the ranks on top of this process's environment.

    Key ``__group__`` carries problems of the group itself (a rank that crashed or hung).
    """
    port = _free_port()
    ctx: Any = None
    if start_method() == "forkserver":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="ds-conformance-ranks-") as tmp:
        selection = Path(tmp) / "cases.json"
        if cases is not None:
            selection.write_text(json.dumps(sorted(cases)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env["OMP_NUM_THREADS"] = "1"
        env.update(env_extra or {})
        procs: list[tuple[Any, Path, IO[str]]] = []
        for rank in range(world):
            out = Path(tmp) / f"rank{rank}.json"
            argv = ["--rank", str(rank), "--world", str(world), "--port", str(port)]
            argv += ["--out", str(out), "--jobs", ",".join(sorted(jobs))]
            if cases is not None:
                argv += ["--cases", str(selection)]
            log: IO[str] = open(Path(tmp) / f"rank{rank}.log", "w+")
            if ctx is not None:
                procs.append((_Forked(ctx, argv, env, log), out, log))
                continue
            cmd = [sys.executable, "-m", "ds_conformance._rank_worker", *argv]
            procs.append(
                (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), out, log)
            )
        deadline = time.monotonic() + GROUP_TIMEOUT
        merged: dict[str, str] = {}
        problems: list[str] = []
        for rank, (proc, out, log) in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                problems.append(f"rank {rank} ran past {GROUP_TIMEOUT:.0f} s")
            log.seek(0)
            tail = " | ".join(log.read().strip().splitlines()[-3:])
            log.close()
            if proc.returncode != 0 or not out.exists():
                problems.append(f"rank {rank} exited with {proc.returncode}: {tail}")
                continue
            for key, failure in json.loads(out.read_text()).items():
                if failure and not merged.get(key):
                    merged[key] = failure
                else:
                    merged.setdefault(key, failure)
        if problems:
            merged["__group__"] = "; ".join(problems)
        return merged


class RankGroups:
    """Lazily spawned groups, one per world size, each running the jobs the run selected."""

    def __init__(self, items: list[pytest.Item]) -> None:
        self._jobs: set[str] = set()
        self._cases: set[str] = set()  # only the selected collective cases run (-k, ids)
        self._dead: set[str] = set()  # the selected dead-peer scenarios
        for item in items:
            module = getattr(item, "module", None)
            name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
            if name in JOB_OF_MODULE:
                self._jobs.add(JOB_OF_MODULE[name])
            params = getattr(getattr(item, "callspec", None), "params", {})
            if params.get("case") is not None:
                self._cases.add(params["case"].key)
            if name == "test_comm" and "dead_peer" in params:
                self._dead.add(params["dead_peer"])
        self._results: dict[int, dict[str, str]] = {}
        self._dead_results: dict[str, str] | None = None

    def result(self, acc: object, world: int, key: str) -> None:
        """Pass, fail or skip the calling test by the ranks' result under ``key``."""
        __tracebackhide__ = True
        _skip_without_devices(acc, world)
        if world not in self._results:
            self._results[world] = spawn_group(world, self._jobs, self._cases)
        _report(self._results[world], key)

    def dead_peer_result(self, acc: object, scenario: str) -> None:
        """Pass, fail or skip the calling test by the dead-peer group's result for
        ``scenario`` (:mod:`ds_conformance.comm_dead_peer`: a group of its own, since one of
        its ranks dies; run once for every selected scenario)."""
        __tracebackhide__ = True
        from ds_conformance import comm_dead_peer as dead

        _skip_without_devices(acc, dead.WORLD)
        try:
            dead.bound_s()  # a bad setting is this test's error, not every rank's
        except ValueError as exc:
            pytest.fail(str(exc), pytrace=False)
        if self._dead_results is None:
            keys = [dead.key(s) for s in sorted(self._dead or {scenario})]
            # Without ds_core's liveness watchdog, which would end the survivor in the
            # backend's stead (docs/architecture.md §3.10).
            self._dead_results = spawn_group(
                dead.WORLD, ["dead_peer"], keys, env_extra={"DS_LIVENESS": "0"}
            )
        _report(self._dead_results, dead.key(scenario))


def _skip_without_devices(acc: object, world: int) -> None:
    device_type = getattr(acc, "device_type", "cpu")
    count = acc.device_count()  # type: ignore[attr-defined]
    if device_type != "cpu" and count < world:
        pytest.skip(f"{world} ranks need {world} devices; this host has {count}")


def _report(results: dict[str, str], key: str) -> None:
    __tracebackhide__ = True
    if key not in results:
        why = results.get("dead_peer[setup]") or results.get("__group__", "not run")
        pytest.fail(f"no result for {key} from the ranks: {why}", pytrace=False)
    if results[key]:
        pytest.fail(results[key], pytrace=False)
