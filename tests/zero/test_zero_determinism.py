"""Two 2-rank trainings under the deterministic policy are bitwise equal, stages 0-3, on cpu and
on the simulated accelerator (:data:`DET_BACKENDS`).

Two models: the ZeRO tests' tiny model (MoE, tied and frozen weights) plus input dropout, under
the config key; and the GPT example's tiny preset (0.1 M parameters, 32 tokens a sample: the
default preset would take minutes on the shared 2-core CI machine), built under
``determinism.enable`` so its initialisation is seeded too. 20 steps of 2 micro-batches each.
Each deterministic run starts from a differently scrambled generator state; a run without the
policy shows that the seeding is what makes them equal.

On sim the dropout masks come from the device's generator, which only the policy's
``manual_seed_all`` seeds. Threads mode, not lazy: there the device's work runs on its own
threads while the host goes on, so a result that depended on timing would differ between the
two runs; lazy mode runs queued work in one order by construction, and proves nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rankpool import RankPools
from tests.zero._common import backend_env
from tests.zero.conftest import BACKENDS

SCENARIOS = ["s0", "s1", "s2", "s3", "s3_ep2"]
GPT = ["gpt_s0", "gpt_s1", "gpt_s2", "gpt_s3"]
#: cpu, and sim in threads mode where installed (see the module docstring).
DET_BACKENDS = [b for b in BACKENDS if b in ("cpu", "sim-threads")]

# slow: trainings on two real rank processes
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", DET_BACKENDS)]


@pytest.fixture(scope="module")
def det_results(
    tmp_path_factory: pytest.TempPathFactory, rank_pools: RankPools
) -> Callable[[str], list[dict[str, Any]]]:
    """``det_results(backend)``: each rank's trainings (tests/zero/_det_worker.py), run once."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def get(backend: str) -> list[dict[str, Any]]:
        if backend not in cache:
            out: Path = tmp_path_factory.mktemp(f"det-{backend}")
            env = backend_env(backend, 2)
            rank_pools.get(2, env).run("tests.zero._det_worker:run_jobs", str(out))
            cache[backend] = [
                torch.load(out / f"det.rank{r}.pt", weights_only=False) for r in range(2)
            ]
        return cache[backend]

    return get


@pytest.fixture
def ranks(det_results: Callable[[str], list[dict[str, Any]]], backend: str) -> list[dict[str, Any]]:
    return det_results(backend)


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


def test_policy_is_on_during_training_and_off_after_destroy(
    ranks: list[dict[str, Any]], backend: str
) -> None:
    device = backend.partition("-")[0]
    for res in ranks:
        for scenario in SCENARIOS:
            det, plain = res[scenario]["det_a"], res[scenario]["plain"]
            assert det["policy_on"] and not det["policy_after_destroy"]
            assert not plain["policy_on"] and plain["knobs"] == []
            assert "torch.use_deterministic_algorithms" in det["knobs"]
            assert (
                "seed:torch.host" in det["knobs"] and f"seed:{device}.device(all)" in det["knobs"]
            )
