"""Run a rank-worker suite once per test session and backend (on the run's rank pools,
tests/rankpool.py), and hand its results to the tests.

The engine's tests are parametrised by backend (``backend`` fixture): each installed entry of
:data:`tests.zero._common.MATRIX_BACKENDS` runs the same suite, and the tests compare every
backend's results with the same single-process host reference.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rankpool import RankPools
from tests.zero._common import MATRIX_BACKENDS, backend_env

ROOT = Path(__file__).resolve().parents[2]


def installed_backends() -> list[str]:
    """The matrix entries this environment can run (sim needs its package and a compiler)."""
    sim = importlib.util.find_spec("ds_backend_sim") is not None and bool(
        shutil.which(os.environ.get("CXX", "c++"))
    )
    return [b for b in MATRIX_BACKENDS if b == "cpu" or (b.startswith("sim") and sim)]


BACKENDS = installed_backends()


class SuiteResults:
    def __init__(self, outdir: Path, world: int) -> None:
        self.outdir, self.world = outdir, world

    def ranks(self, job: str) -> list[dict[str, Any]]:
        return [
            torch.load(self.outdir / f"{job}.rank{r}.pt", weights_only=False)
            for r in range(self.world)
        ]


def run_suite(pools: RankPools, tmp: Path, suite: str, world: int, backend: str) -> SuiteResults:
    env = backend_env(backend, world)
    if suite == "resident":  # large frees go back to the OS, so RSS tracks live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    pools.get(world, env).run("tests.zero._worker:run_jobs", suite, str(tmp))
    return SuiteResults(tmp, world)


SuiteGetter = Callable[..., SuiteResults]


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory, rank_pools: RankPools) -> SuiteGetter:
    """``suite(name, world, backend="cpu")``: the suite's results, run once per session."""
    cache: dict[tuple[str, int, str], SuiteResults] = {}

    def get(name: str, world: int, backend: str = "cpu") -> SuiteResults:
        key = (name, world, backend)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"{name}{world}-{backend}")
            cache[key] = run_suite(rank_pools, tmp, name, world, backend)
        return cache[key]

    return get


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each installed backend of the engine's test matrix."""
    return str(request.param)
