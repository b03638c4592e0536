"""Groups of rank processes shared by every multi-rank test of a run.

Spawning ranks and forming a process group costs seconds, so one group per world size runs
every multi-rank job the selected tests need (``comm``: every collective case; ``zero``: the
ZeRO smoke runs) and each test then reads its own result. Ranks are processes on the ``cpu``
device type; elsewhere a world size needs that many devices, else its tests skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

# Seconds a whole group may take; a hung collective makes every result of the group fail.
GROUP_TIMEOUT = 600.0
#: test module -> the rank job it reads results from
JOB_OF_MODULE: dict[str, str] = {"test_comm": "comm", "test_zero": "zero"}


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
    with tempfile.TemporaryDirectory(prefix="ds-conformance-ranks-") as tmp:
        selection = Path(tmp) / "cases.json"
        if cases is not None:
            selection.write_text(json.dumps(sorted(cases)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env["OMP_NUM_THREADS"] = "1"
        env.update(env_extra or {})
        procs = []
        for rank in range(world):
            out = Path(tmp) / f"rank{rank}.json"
            cmd = [sys.executable, "-m", "ds_conformance._rank_worker"]
            cmd += ["--rank", str(rank), "--world", str(world), "--port", str(port)]
            cmd += ["--out", str(out), "--jobs", ",".join(sorted(jobs))]
            if cases is not None:
                cmd += ["--cases", str(selection)]
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
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
