"""Shared test setup: the CPU backend is chosen explicitly (docs/architecture.md §3.1), and
multi-rank suites run on rank worker processes shared by the whole run (tests/rankpool.py)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest

from tests.rankpool import RankPools

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    """The run's rank pools: ``rank_pools.get(world, env)``."""
    pools = RankPools()
    yield pools
    pools.close()


#: tests started and not yet finished (the controller's view: xdist forwards its workers'
#: start and finish events), with their start time
_running: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str) -> None:
    _running[nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid: str) -> None:
    _running.pop(nodeid, None)


def pytest_keyboard_interrupt() -> None:
    """Name the tests an interrupted run was in, with how long each had run: a run stopped
    from outside (Ctrl+C, .ci/run's time limit) shows where its time went."""
    now = time.monotonic()
    for nodeid, start in sorted(_running.items(), key=lambda kv: kv[1]):
        print(f"interrupted while running ({now - start:.0f} s): {nodeid}", file=sys.stderr)


# the bad-input corpus's end-of-run table (issue 29 §6)
from tests._bad_inputs_report import (  # noqa: E402
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

__all__ = [
    "pytest_runtest_logreport",
    "pytest_runtest_makereport",
    "pytest_terminal_summary",
    "rank_pools",
]
