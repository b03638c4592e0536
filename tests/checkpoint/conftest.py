"""Run rank-worker suites once per test session (on the run's rank pools, tests/rankpool.py);
``*_load`` suites first run their ``*_save``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rankpool import RankPools

ROOT = Path(__file__).resolve().parents[2]

#: suite -> (world size, suite that must run first)
SUITES: dict[str, tuple[int, str | None]] = {
    "resume_save": (2, None),
    "resume_load": (2, "resume_save"),
    "reshard_save": (4, None),
    "reshard_w2": (2, "reshard_save"),
    "reshard_w1": (1, "reshard_save"),
    "nvme_save": (2, None),
    "nvme_load": (2, "nvme_save"),
    "tp_save": (2, None),
    "tp_w1": (1, "tp_save"),
    "ep_save": (2, None),
    "ep_w1": (1, "ep_save"),
    "ep_tp": (4, None),
}


class SuiteResults:
    def __init__(self, outdir: Path, world: int, ckroot: Path) -> None:
        self.outdir, self.world, self.ckroot = outdir, world, ckroot

    def ranks(self, job: str) -> list[dict[str, Any]]:
        return [
            torch.load(self.outdir / f"{job}.rank{r}.pt", weights_only=False)
            for r in range(self.world)
        ]


def worker_env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


@pytest.fixture(scope="session")
def ckroot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckroot")


@pytest.fixture(scope="session")
def suite(
    tmp_path_factory: pytest.TempPathFactory, ckroot: Path, rank_pools: RankPools
) -> Callable[[str], SuiteResults]:
    cache: dict[str, SuiteResults] = {}

    def get(name: str) -> SuiteResults:
        if name in cache:
            return cache[name]
        world, before = SUITES[name]
        if before is not None:
            get(before)
        outdir = tmp_path_factory.mktemp(name)
        env = {"DS_ACCELERATOR": "cpu"}
        if before is not None:
            # Readers never run in the ranks that saved: a resume that depends on state the
            # saving process still holds (RNGs, caches) would pass there and fail for users.
            env["DS_TEST_POOL"] = "readers"
        rank_pools.get(world, env).run(
            "tests.checkpoint._worker:run_jobs", name, str(outdir), str(ckroot)
        )
        cache[name] = SuiteResults(outdir, world, ckroot)
        return cache[name]

    return get
