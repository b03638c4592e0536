"""Collectives on 2 and 4 real ranks over the backend's comm library, checked locally.

One group of rank processes per world size runs every case (see :mod:`comm_cases`); the
tests below report each case. Ranks are processes on the ``cpu`` device type; elsewhere a
world size needs that many devices, else its cases skip.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from ds_conformance.comm_cases import Case, cases
from ds_conformance.marks import hooks, tier

pytestmark = tier("multi-rank")

# Seconds a whole group may take; a hung collective makes every case of the group fail.
GROUP_TIMEOUT = 600.0


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        from ds_conformance.plugin import suite_of

        collective = metafunc.function.__name__.removeprefix("test_")
        chosen = [
            c
            for c in cases(suite_of(metafunc.config).acc.supported_dtypes())
            if c.collective == collective
        ]
        metafunc.parametrize("case", chosen, ids=[c.id for c in chosen])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawn_group(world: int) -> dict[str, str]:
    """Run every case of ``world`` ranks; return case key -> "" (pass) or the failure."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="ds-conformance-ranks-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env["OMP_NUM_THREADS"] = "1"
        procs = []
        for rank in range(world):
            out = Path(tmp) / f"rank{rank}.json"
            cmd = [
                sys.executable,
                "-m",
                "ds_conformance._rank_worker",
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--out",
                str(out),
            ]
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


@pytest.fixture(scope="session")
def groups() -> dict[int, dict[str, str]]:
    return {}


def _result(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    __tracebackhide__ = True
    if acc.device_type != "cpu" and acc.device_count() < case.world:
        pytest.skip(
            f"{case.world} ranks need {case.world} devices; this host has {acc.device_count()}"
        )
    if case.world not in groups:
        groups[case.world] = _spawn_group(case.world)
    results = groups[case.world]
    key = f"{case.collective}[{case.id}]"
    if key not in results:
        pytest.fail(
            f"no result for {key} from the ranks: {results.get('__group__', 'case not run')}",
            pytrace=False,
        )
    if results[key]:
        pytest.fail(results[key], pytrace=False)


@hooks("ds_comm_all_reduce", "ds_comm_prepare", "ds_comm_backend_name")
def test_all_reduce(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    _result(acc, groups, case)


@hooks("ds_comm_all_gather")
def test_all_gather(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    _result(acc, groups, case)


@hooks("ds_comm_reduce_scatter")
def test_reduce_scatter(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    _result(acc, groups, case)


@hooks("ds_comm_broadcast")
def test_broadcast(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    _result(acc, groups, case)


@hooks("ds_comm_all_to_all")
def test_all_to_all(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    _result(acc, groups, case)


@hooks("ds_comm_barrier")
def test_barrier(acc: Any, groups: dict[int, dict[str, str]], case: Case) -> None:
    _result(acc, groups, case)


@hooks("ds_comm_backend_name")
def test_backend_name_is_a_torch_distributed_backend(acc: Any) -> None:
    import torch.distributed as dist

    name = acc.communication_backend_name()
    acc.prepare_communication()
    known = {b.lower() for b in dist.Backend.backend_list} | {
        b.lower() for b in getattr(dist.Backend, "_plugins", {})
    }
    if name.lower() not in known:
        pytest.fail(
            f"communication_backend_name()={name!r}, but should be one of {sorted(known)} after ds_comm_prepare [ds_comm_backend_name]",
            pytrace=False,
        )
