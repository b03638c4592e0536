"""Run a rank-worker suite once per test session and backend, and hand its results to the tests.

The engine's tests are parametrised by backend (``backend`` fixture): each installed entry of
:data:`tests.zero._common.MATRIX_BACKENDS` runs the same suite, and the tests compare every
backend's results with the same single-process host reference.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

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


def run_suite(tmp: Path, suite: str, world: int, backend: str = "cpu") -> SuiteResults:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    env.update(OMP_NUM_THREADS="1", **backend_env(backend, world))
    if suite == "resident":  # large frees go back to the OS, so RSS tracks live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.zero._worker", suite, str(world), str(tmp), backend],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"worker suite {suite} on {world} ranks ({backend}) failed:\n{proc.stderr[-6000:]}"
        )
    return SuiteResults(tmp, world)


SuiteGetter = Callable[..., SuiteResults]


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory) -> SuiteGetter:
    """``suite(name, world, backend="cpu")``: the suite's results, run once per session."""
    cache: dict[tuple[str, int, str], SuiteResults] = {}

    def get(name: str, world: int, backend: str = "cpu") -> SuiteResults:
        key = (name, world, backend)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"{name}{world}-{backend}")
            cache[key] = run_suite(tmp, name, world, backend)
        return cache[key]

    return get


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each installed backend of the engine's test matrix."""
    return str(request.param)
