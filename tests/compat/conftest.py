"""Run the DeepSpeed-style loops once per session on 2 gloo ranks of the run's rank pools
(tests/compat/_worker.py, tests/rankpool.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.rankpool import RankPools

WORLD = 2


@pytest.fixture(scope="session")
def loops(tmp_path_factory: pytest.TempPathFactory, rank_pools: RankPools) -> list[dict[str, Any]]:
    """Per rank: job name -> that loop's results."""
    tmp = tmp_path_factory.mktemp("compat_loops")
    pool = rank_pools.get(WORLD, {"DS_ACCELERATOR": "cpu"})
    return pool.run("tests.compat._worker:run_loops", str(tmp))
