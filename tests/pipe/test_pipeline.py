"""Pipeline parallelism (``ds_core.pipe``): training on 1, 2 and 4 ranks against
single-process PyTorch (tests/pipe/_worker.py), and the refusals.

Tolerance (docs/architecture.md §3.12): fp32 losses and parameters within 1e-5 relative, 1e-6
absolute. Every training case clips at 0.3, below the gradient norm of every step, so a norm
that missed a stage (or counted a tied weight twice) changes every update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.pipe import _worker as worker
from tests.rankpool import RankPools
from tests.zero._common import backend_env

JOB = "tests.pipe._worker"
RunJob = Callable[..., list[Any]]


@pytest.fixture
def run_ranks(rank_pools: RankPools, backend: str) -> RunJob:
    """``run_ranks(world, "function", *args)``: the job's result on each rank, in rank order."""

    def run(world: int, job: str, *args: Any) -> list[Any]:
        return rank_pools.get(world, backend_env(backend, world)).run(f"{JOB}:{job}", *args)

    return run


# -- training against the single-process reference (2 and 4 ranks) -------------------------

STEPS = 3


def _check_training(results: list[dict[str, Any]], pp: int, case: tuple[Any, ...]) -> None:
    kind, gas, steps = case[2], case[3], case[5]
    replicas = len(results) // pp
    batches = worker.data(kind, steps + 1, replicas, gas)
    ref = worker.reference(kind, batches[:steps], worker.CLIP)
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert r["global_steps"] == steps
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r["params"].items():
            if name in merged:  # a DP replica or a tie's copy: the same values
                torch.testing.assert_close(value, merged[name], rtol=1e-5, atol=1e-6)
            merged[name] = value
    assert set(merged) == set(ref["params"]), (case, sorted(merged))
    for name, value in ref["params"].items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
    want_eval = worker.eval_reference(kind, batches[steps], ref["params"])
    for r in results:
        assert r["eval"] == pytest.approx(want_eval, rel=1e-5, abs=1e-6)
    assert [r["first"] for r in results] == [r["stage"] == 0 for r in results]
    assert [r["last"] for r in results] == [r["stage"] == pp - 1 for r in results]


@pytest.mark.slow
def test_pp2_matches_single_process(run_ranks: RunJob) -> None:
    """PP=2 on 2 ranks at ZeRO 0, 1 and 2: plain layers with 3 micro-batches, a tied
    embedding / LM head, activation checkpointing, and fewer micro-batches than stages."""
    cases = [
        (2, 0, "mlp", 3, 0, STEPS),
        (2, 1, "tied", 3, 0, STEPS),
        (2, 2, "mlp", 3, 1, STEPS),
        (2, 2, "tied", 1, 2, STEPS),
    ]
    per_rank = run_ranks(2, "train_cases", cases)
    for i, case in enumerate(cases):
        _check_training([r[i] for r in per_rank], 2, case)


@pytest.mark.slow
def test_pp2_dp2_and_pp4_match_single_process(run_ranks: RunJob) -> None:
    """PP=2 × DP=2 on 4 ranks at ZeRO 0, 1 and 2 (a tie and checkpointing among them), and
    PP=4, whose middle stages both receive and send activations and gradients."""
    cases = [
        (2, 0, "tied", 2, 0, STEPS),
        (2, 1, "mlp", 2, 1, STEPS),
        (2, 2, "tied", 3, 1, STEPS),
        (4, 1, "deep", 5, 0, 2),
    ]
    per_rank = run_ranks(4, "train_cases", cases)
    for i, case in enumerate(cases):
        _check_training([r[i] for r in per_rank], case[0], case)


@pytest.mark.slow
def test_bad_inputs_are_named(run_ranks: RunJob) -> None:
    got = run_ranks(2, "bad_inputs")
    for msgs in got:
        assert (
            "ConfigError" in msgs["few_layers"]
            and "1 layers for num_stages=2" in msgs["few_layers"]
        )
        assert "num_stages=3" in msgs["bad_stages"] and "world size 2" in msgs["bad_stages"]
        assert "stage 3" in msgs["stage3"] and "use stage 0, 1 or 2" in msgs["stage3"]
        assert "gradient_accumulation_steps=2" in msgs["exhausted"]
        assert "NotSupportedError" in msgs["no_p2p"] and "'p2p'" in msgs["no_p2p"]
        assert "pipeline parallelism over 2 stages" in msgs["no_p2p"]
        assert "PipelineError" in msgs["forward"]
        assert "PipelineError" in msgs["checkpoint"] and "save_16bit_model" in msgs["checkpoint"]
        assert float(msgs["after"]) > 0
        assert len(msgs["loader"]) == 3 and all(v > 0 for v in msgs["loader"])


# -- one process ----------------------------------------------------------------------------


def test_partition_errors_name_the_value(run_ranks: RunJob) -> None:
    msgs = run_ranks(1, "partition_errors")[0]
    assert "type:Conv" in msgs["regex"] and "Linear" in msgs["regex"]
    assert "'bogus'" in msgs["method"]
    assert "layers[1]" in msgs["layer"]
    assert "topology" in msgs["topology"]


def test_pp1_trains_like_single_process(run_ranks: RunJob) -> None:
    case = (1, 0, "tied", 2, 1, 2)
    _check_training([run_ranks(1, "train_cases", [case])[0][0]], 1, case)


@pytest.mark.slow
def test_fp16_stages_skip_together(run_ranks: RunJob) -> None:
    """The overflow verdict comes from the norm over every stage: both stages skip the same
    steps and keep the same loss scale (else their parameters would drift apart)."""
    got = run_ranks(2, "fp16_case", 2)
    assert got[0] == got[1]
    assert got[0]["skipped"] >= 1  # the initial scale overflows at first
    assert all(torch.isfinite(torch.tensor(got[0]["losses"])))
