"""Run rank-worker suites once per test session and backend (on the run's rank pools,
tests/rankpool.py); ``*_load`` suites first run their ``*_save``.

The resume and reshard tests are parametrised by backend (``backend`` fixture): each entry of
:data:`CHECKPOINT_BACKENDS` runs the same suites, each backend with its own checkpoint folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rankpool import RankPools
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

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


#: The backends the checkpoint suites run on: cpu and, when installed, sim in its threads mode.
#: Not sim-lazy: it would run the whole save/load matrix a third time (minutes on 2 shared
#: cores) for what the engine tests already cover; a checkpoint's device-specific parts
#: (placement, device index, transfers to and from the host) are the same in both async modes.
CHECKPOINT_BACKENDS = tuple(b for b in installed_backends() if b in ("cpu", "sim-threads"))


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
    """The checkpoint root of the ``cpu`` suites (each backend has its own: ``suite``)."""
    return tmp_path_factory.mktemp("ckroot")


SuiteGetter = Callable[..., SuiteResults]


@pytest.fixture(scope="session")
def suite(
    tmp_path_factory: pytest.TempPathFactory, ckroot: Path, rank_pools: RankPools
) -> SuiteGetter:
    """``suite(name, backend="cpu", saved_on=None)``: the suite's results, run once per session.

    The suite that must run first (its ``*_save``) runs on ``saved_on`` (default: ``backend``),
    and ``name`` reads that backend's checkpoints: ``saved_on`` other than ``backend`` loads a
    checkpoint written on one backend on another.
    """
    cache: dict[tuple[str, str, str], SuiteResults] = {}
    roots: dict[str, Path] = {"cpu": ckroot}

    def root_of(backend: str) -> Path:
        if backend not in roots:
            roots[backend] = tmp_path_factory.mktemp(f"ckroot-{backend}")
        return roots[backend]

    def get(name: str, backend: str = "cpu", saved_on: str | None = None) -> SuiteResults:
        source = saved_on or backend
        key = (name, backend, source)
        if key in cache:
            return cache[key]
        world, before = SUITES[name]
        if before is not None:
            get(before, source)
        elif source != backend:
            raise ValueError(f"{name} saves its own checkpoints: saved_on={saved_on!r}")
        outdir = tmp_path_factory.mktemp(
            f"{name}-{backend}" + (f"-from-{source}" * (source != backend))
        )
        env = backend_env(backend, world)
        if before is not None:
            # Readers never run in the ranks that saved: a resume that depends on state the
            # saving process still holds (RNGs, caches) would pass there and fail for users.
            env["DS_TEST_POOL"] = "readers"
        root = root_of(source)
        rank_pools.get(world, env).run(
            "tests.checkpoint._worker:run_jobs", name, str(outdir), str(root)
        )
        cache[key] = SuiteResults(outdir, world, root)
        return cache[key]

    return get


@pytest.fixture(params=CHECKPOINT_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend of :data:`CHECKPOINT_BACKENDS`."""
    return str(request.param)
