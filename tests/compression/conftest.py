"""Tests of communication-efficient training: the 1-bit all-reduce and the optimizers on it,
Lamb, ZeRO++'s quantized collectives. Multi-rank jobs run on the session's rank pools
(tests/rankpool.py), once per installed backend of the engine's matrix (cpu, and sim in both
async modes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.rankpool import RankPools
from tests.zero._common import backend_env
from tests.zero.conftest import BACKENDS

RunJob = Callable[..., list[Any]]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each installed backend of the engine's test matrix."""
    return str(request.param)


@pytest.fixture
def run_ranks(rank_pools: RankPools, backend: str) -> RunJob:
    """``run_ranks(world, "module:function", *args)``: the job's result on each rank, in rank
    order, on ``world`` ranks of the current backend."""

    def run(world: int, target: str, *args: Any) -> list[Any]:
        return rank_pools.get(world, backend_env(backend, world)).run(target, *args)

    return run
