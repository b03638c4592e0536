"""Run the DeepSpeed-style loops once per session on 2 gloo ranks (tests/compat/_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


@pytest.fixture(scope="session")
def loops(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per rank: job name -> that loop's results."""
    tmp = tmp_path_factory.mktemp("compat_loops")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compat._worker", str(WORLD), str(tmp)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise AssertionError(f"compat loops failed on {WORLD} ranks:\n{proc.stderr[-6000:]}")
    return [torch.load(tmp / f"loops.rank{r}.pt", weights_only=False) for r in range(WORLD)]
