"""Model-state memory through the memory hooks (resident set size), teardown, and drift.

Two gloo ranks run with MALLOC_MMAP_THRESHOLD_=65536 so glibc maps large tensors with mmap and
returns them on free: the resident set then tracks live tensors. The model has 8.4 M
parameters (134 MiB of fp32 AdamW states), trained with micro-batch 1 so activations are small.
"Flat" is docs/architecture.md §3.5's: growth under 5% + 16 MiB after warm-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.zero.conftest import SuiteResults

pytestmark = pytest.mark.slow

N = 2
MiB = 2**20
# Without accumulation stage 1 keeps only its gradient partition, like stage 2.
FORMULA = {0: 4 + 4 + 8, 1: 4 + (4 + 8) / N, 2: 4 + (4 + 8) / N, 3: (4 + 4 + 8) / N}


@pytest.fixture(scope="module")
def ranks(suite: Callable[[str, int], SuiteResults]) -> list[dict[str, Any]]:
    return suite("resident", N).ranks("resident")


def _flat(values: list[int], what: str) -> None:
    first, last = values[0], max(values)
    assert last - first <= 0.05 * first + 16 * MiB, (
        f"{what}: resident grew from {first / MiB:.1f} to {last / MiB:.1f} MiB"
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resident_model_states_match_formula(ranks: list[dict[str, Any]], stage: int) -> None:
    for rank, res in enumerate(ranks):
        # model states plus the reducer's reusable staging buffers (a bucket each, two with
        # overlap_comm): gradient memory beyond the formula is bounded by buckets, not the model
        expected = FORMULA[stage] * res["psi"] + res[f"s{stage}"]["staging"]
        got = res[f"s{stage}"]["rss"]
        assert abs(got - expected) <= 0.10 * expected, (
            f"rank {rank} stage {stage}: resident growth={got / MiB:.1f} MiB, but should be "
            f"{expected / MiB:.1f} MiB ±10% (engine buffers {res[f's{stage}']['buffers'] / MiB:.1f} MiB)"
        )


def test_destroying_engines_releases_their_buffers(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        _flat(res["after_destroy"][1:], "20 engines created and destroyed")
        # with offload: host masters, accumulators, cpu_adam state and stage-3 host shards
        _flat(res["offload_after_destroy"][1:], "20 offload engines created and destroyed")


def test_no_growth_over_100_steps(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        _flat(res["drift"], "100 steps of stage 2")
