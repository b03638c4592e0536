"""Shared test setup: the CPU backend is chosen explicitly (docs/architecture.md §3.1), and
multi-rank suites run on rank worker processes shared by the whole run (tests/rankpool.py)."""

from __future__ import annotations

import os
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
