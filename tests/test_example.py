"""The README's main job: examples/train_gpt.py trains under torchrun with 2 CPU ranks."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_train_gpt_runs_under_torchrun_with_two_ranks(tmp_path: Path, stage: int) -> None:
    steps = 8
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--model", "tiny", "--steps", str(steps), "--micro-batch", "4", "--seq", "32", "--lr", "1e-2",
        "--stage", str(stage), "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "summary: final loss" in proc.stdout
    # ZeRO's volume per step: 2Ψ at stages 1/2, 3Ψ at stage 3 (Ψ = fp32 gradient bytes)
    assert f"({2 if stage < 3 else 3}.00 Ψ" in proc.stdout, proc.stdout
    assert f"step {steps}/{steps}" in proc.stderr

    with open(tmp_path / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    losses = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # it learns
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "train_gpt.png").stat().st_size > 10_000
