"""PyTorch-style backward (DeepSpeed 0.19): ``loss.backward()`` on a loss computed from the
engine's forward outputs, and ``engine.scale(loss).backward()`` under fp16, train as
``engine.backward(loss)`` does, on 1 and 2 ranks of every installed backend.

Tolerances: with one micro-batch per step the two backwards run the same ops, so the
parameters match bitwise. With accumulation, ``engine.backward`` divides the loss by the
accumulation steps and the PyTorch-style backward divides the output's gradient, so the
gradients differ by rounding: fp32 parameters within 1e-6 (3e-8 seen). Under fp16 the
output's gradient is an fp16 tensor, so the division rounds each element to fp16 (in
``engine.backward`` it is one fp32 division of the loss): fp16 parameters within 5e-4
(1.2e-4 seen, one fp16 ulp of a parameter near 0.25; AdamW's normalisation carries a rounded
gradient into the update whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.rankpool import RankPools
from tests.zero._common import backend_env

JOBS = "tests.zero._torch_backward_jobs"
RunJob = Callable[..., list[Any]]
STAGES = [0, 1, 2, 3]
WORLDS = [1, pytest.param(2, marks=pytest.mark.slow)]


@pytest.fixture
def run_ranks(rank_pools: RankPools, backend: str) -> RunJob:
    """``run_ranks(world, "function", *args)``: the job's result on each rank, in rank order,
    on ``world`` ranks of the current backend."""

    def run(world: int, job: str, *args: Any) -> list[Any]:
        return rank_pools.get(world, backend_env(backend, world)).run(f"{JOBS}:{job}", *args)

    return run


def assert_params_match(
    got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], exact: bool, fp16: bool
) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in w:
            if exact:
                assert torch.equal(g[name], w[name]), f"step {step + 1}: {name} differs"
            elif fp16:
                torch.testing.assert_close(g[name], w[name], rtol=0, atol=5e-4)
            else:
                torch.testing.assert_close(g[name], w[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_loss_backward_matches_engine_backward(
    run_ranks: RunJob, world: int, stage: int, gas: int, precision: str
) -> None:
    fp16 = precision == "fp16"
    for rank_result in run_ranks(world, "compare", stage, gas, fp16):
        eng, tor = rank_result["engine"], rank_result["torch"]
        # _loss_count counts every micro-batch of the window, PyTorch-style ones included.
        assert tor["counts"] == eng["counts"] == [m % gas + 1 for m in range(3 * gas)]
        assert_params_match(tor["params"], eng["params"], exact=gas == 1, fp16=fp16)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_two_backwards_through_one_forward(
    run_ranks: RunJob, world: int, stage: int, precision: str
) -> None:
    """Two losses from one forward, ``retain_graph``: two micro-batch backwards, as two
    ``engine.backward`` calls (the same ops: bitwise)."""
    fp16 = precision == "fp16"
    want = run_ranks(world, "two_losses", stage, fp16, "e")
    got = run_ranks(world, "two_losses", stage, fp16, "t")
    for g, w in zip(got, want, strict=True):
        assert g["counts"] == w["counts"] == [2, 2, 2]
        assert_params_match(g["params"], w["params"], exact=True, fp16=fp16)


@pytest.mark.slow
def test_two_reducing_backwards_at_an_accumulation_boundary(run_ranks: RunJob) -> None:
    """Two losses backpropagated in a window's last micro-batch: each backward reduces, and
    the window's gradient is their sum with the earlier micro-batch's at every stage. Stage 1
    with accumulation lands its first reduction inside the accumulator the second backward
    refills (ds_core/zero/grad_paths.py, ``LocalAccumulation``), so it must set it aside.
    Stages differ only in summation order: fp32 parameters within 1e-6."""
    want = run_ranks(2, "boundary_two_losses", 0)
    for stage in (1, 2, 3):
        for g, w in zip(run_ranks(2, "boundary_two_losses", stage), want, strict=True):
            assert_params_match(g["params"], w["params"], exact=False, fp16=False)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_mixed_backwards_in_one_window(
    run_ranks: RunJob, world: int, stage: int, precision: str
) -> None:
    fp16 = precision == "fp16"
    for r in run_ranks(world, "mixed", stage, fp16):
        assert r["mixed"]["counts"] == r["engine"]["counts"]
        assert_params_match(r["mixed"]["params"], r["engine"]["params"], exact=False, fp16=fp16)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_fp16_unscaled_backward_raises(run_ranks: RunJob, world: int, stage: int) -> None:
    for r in run_ranks(world, "fp16_unscaled", stage):
        assert "engine.scale(loss).backward()" in r["message"]
        assert "engine.backward(loss)" in r["message"]
        # Refused before any gradient: nothing counted, no gradient left on a parameter.
        assert r["after"] == {"count": 0, "in_backward": False, "grads": [False] * 4}
        assert r["moved"]


def test_backward_reaching_no_parameter_raises(run_ranks: RunJob) -> None:
    (r,) = run_ranks(1, "no_parameter")
    assert "reached none of the model's trainable parameters" in r["message"]
    assert r["state"] == (None, False)


@pytest.mark.parametrize("stage", [0, 2])
def test_gan_generator_loss_through_discriminator_engine(run_ranks: RunJob, stage: int) -> None:
    """Both styles are a backward of both engines, as in DeepSpeed 0.19.8 (stages 1–3; its
    stage 0 refuses): the discriminator counts it and takes its gradients into its window.
    ``G_engine.backward(errG)`` divides by G's accumulation steps only (DeepSpeed's
    ``_backward_prologue_per_tensor`` skips the division inside an engine's backward); a
    plain ``errG.backward()`` divides by the discriminator's too
    (tests/compat/test_outside_backward.py compares with DeepSpeed)."""
    (e,) = run_ranks(1, "gan", stage, "e")
    assert (e["d_count"], e["g_count"]) == (1, 1)
    assert not any(e["d_grads_on_params"])
    assert e["ratio"] == pytest.approx(1 / 3, rel=1e-5)
    (t,) = run_ranks(1, "gan", stage, "t")
    assert (t["d_count"], t["g_count"]) == (1, 1)
    assert not any(t["d_grads_on_params"])
    assert t["ratio"] == pytest.approx(1 / 9, rel=1e-5)
