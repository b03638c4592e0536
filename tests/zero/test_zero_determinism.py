"""Two 2-rank trainings under the deterministic policy are bitwise equal, stages 0-3.

Two models: the ZeRO tests' tiny model (MoE, tied and frozen weights) plus input dropout, under
the config key; and the GPT example's tiny preset (0.1 M parameters, 32 tokens a sample: the
default preset would take minutes on the shared 2-core CI machine), built under
``determinism.enable`` so its initialisation is seeded too. 20 steps of 2 micro-batches each.
Each deterministic run starts from a differently scrambled generator state; a run without the
policy shows that the seeding is what makes them equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ["s0", "s1", "s2", "s3", "s3_ep2"]
GPT = ["gpt_s0", "gpt_s1", "gpt_s2", "gpt_s3"]

pytestmark = pytest.mark.slow  # two trainings on two real rank processes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("det")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.zero._det_worker", "2", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise AssertionError(f"determinism worker failed:\n{proc.stderr[-6000:]}")
    return [torch.load(out / f"det.rank{r}.pt", weights_only=False) for r in range(2)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested tensors/containers (NaN-safe: compares the bits)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("scenario", SCENARIOS + GPT)
def test_two_runs_under_the_policy_are_bitwise_equal(
    ranks: list[dict[str, Any]], scenario: str
) -> None:
    for rank, res in enumerate(ranks):
        a, b = res[scenario]["det_a"], res[scenario]["det_b"]
        for part in ("losses", "params", "optim"):
            assert _equal(a[part], b[part]), f"rank {rank} {scenario}: {part} differ"


@pytest.mark.parametrize("scenario", SCENARIOS + GPT)
def test_without_the_policy_the_same_runs_differ(
    ranks: list[dict[str, Any]], scenario: str
) -> None:
    """The control: without seeding, the scrambled generators give other dropout and data."""
    a, plain = ranks[0][scenario]["det_a"], ranks[0][scenario]["plain"]
    assert not _equal(a["losses"], plain["losses"])


def test_policy_is_on_during_training_and_off_after_destroy(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        for scenario in SCENARIOS:
            det, plain = res[scenario]["det_a"], res[scenario]["plain"]
            assert det["policy_on"] and not det["policy_after_destroy"]
            assert not plain["policy_on"] and plain["knobs"] == []
            assert "torch.use_deterministic_algorithms" in det["knobs"]
            assert "seed:torch.host" in det["knobs"] and "seed:cpu.device(all)" in det["knobs"]
