"""Run a rank-worker suite once per test session and hand its results to the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


class SuiteResults:
    def __init__(self, outdir: Path, world: int) -> None:
        self.outdir, self.world = outdir, world

    def ranks(self, job: str) -> list[dict[str, Any]]:
        return [
            torch.load(self.outdir / f"{job}.rank{r}.pt", weights_only=False)
            for r in range(self.world)
        ]


def run_suite(tmp: Path, suite: str, world: int) -> SuiteResults:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    if suite == "resident":  # large frees go back to the OS, so RSS tracks live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.zero._worker", suite, str(world), str(tmp)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"worker suite {suite} on {world} ranks failed:\n{proc.stderr[-6000:]}"
        )
    return SuiteResults(tmp, world)


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], SuiteResults]:
    cache: dict[tuple[str, int], SuiteResults] = {}

    def get(name: str, world: int) -> SuiteResults:
        key = (name, world)
        if key not in cache:
            cache[key] = run_suite(tmp_path_factory.mktemp(f"{name}{world}"), name, world)
        return cache[key]

    return get
