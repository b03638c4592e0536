"""Training under real ``torchrun`` launches on loopback.

- two torchrun agents as two nodes (``--nnodes 2``, c10d rendezvous, one rank each) train
  ZeRO stages 2 and 3 and match the single-process reference;
- ``torchrun --nproc_per_node 2 examples/train_gpt.py`` trains the tiny GPT at every stage and
  each loss curve matches stage 0's (fp32, 1e-5 relative); the model's size does not change
  what is compared, and the small one's steps took most of this file's time.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rankpool import free_port
from tests.zero._worker import stage_scenarios
from tests.zero.conftest import ROOT, SuiteResults
from tests.zero.test_zero_stages import check_against_reference

pytestmark = pytest.mark.slow

TIMEOUT = 600  # a hang guard only, not a speed check


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def test_two_torchrun_nodes_train_stages_2_and_3(tmp_path: Path) -> None:
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                f"zero-{port}",
                "--local_addr",
                "127.0.0.1",
                "tests/zero/_torchrun_job.py",
                str(tmp_path),
                "s2",
                "s3",
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = [a.communicate(timeout=TIMEOUT)[0] for a in agents]
    for node, (agent, log) in enumerate(zip(agents, logs, strict=True)):
        assert agent.returncode == 0, f"node {node} failed:\n{log[-4000:]}"
    results = SuiteResults(tmp_path, 2)
    for name in ("s2", "s3"):
        check_against_reference(stage_scenarios(2)[name], results.ranks(name))


# Seen intermittently under heavy load on this 2-core machine (torch 2.13, gloo): a rank that
# has finished, written its results and called destroy_process_group() aborts during
# interpreter teardown ("terminate called without an active exception"). It is not a training
# failure, so such a run is retried once; any other failure, or a second one, fails the test.
_TEARDOWN_ABORT = "terminate called without an active exception"


def _gpt_losses(out: Path, stage: int) -> list[float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "examples/train_gpt.py", "--model", "tiny", "--seq", "32", "--stage", str(stage),
        "--steps", "10", "--no-plot", "--out", str(out / f"s{stage}"),
    ]  # fmt: skip
    for _attempt in (1, 2):
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT
        )
        finished = "step 10/10" in proc.stderr  # every step ran before the abort
        if proc.returncode == 0 or not (finished and _TEARDOWN_ABORT in proc.stderr):
            break
    if proc.returncode != 0:  # the first lines name the cause; the tail is torchrun's summary
        lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("frame #", "  "))]
        raise AssertionError(
            f"stage {stage} failed (attempt {_attempt}):\n"
            + "\n".join([*lines[:40], "...", *lines[-15:]])
        )
    with open(out / f"s{stage}" / "train_log.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def test_gpt_example_loss_curve_matches_stage_0_at_every_stage(tmp_path: Path) -> None:
    if not (ROOT / "examples" / "train_gpt.py").exists():
        pytest.fail("examples/train_gpt.py is missing")
    base = _gpt_losses(tmp_path, 0)
    assert len(base) == 10 and base[-1] < base[0], f"stage 0 did not train: {base}"
    for stage in (1, 2, 3):
        got = _gpt_losses(tmp_path, stage)
        for step, (a, b) in enumerate(zip(got, base, strict=True), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), (
                f"stage {stage} step {step}: loss={a}, but should be {b}"
            )
