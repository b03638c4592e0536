"""fp16 dynamic loss scaling and bf16 overflow skipping, every stage, on 2 gloo ranks.

Overflows are injected on one rank only (loss × inf on rank 0 for fp16, × NaN on rank 1 for
bf16), so every rank must learn of them through the engine's global check.
"""

from __future__ import annotations

import pytest
import torch

from tests.zero._worker import FP16_OVERFLOWS
from tests.zero.conftest import SuiteGetter

pytestmark = pytest.mark.slow

# initial_scale_power 4, loss_scale_window 2, hysteresis 2, min_loss_scale 2, worked by hand:
# overflow 1 spends the hysteresis, overflow 2 halves; two clean steps after an overflow double
# (and refill the hysteresis); four overflows in a row end at the floor.
EXPECTED_SCALES = [16.0, 16.0, 8.0, 8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0]


@pytest.mark.parametrize("path", ["fp16", "fp16f"], ids=["host-skip", "device-skip"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_loss_scale_trajectory_and_skipped_steps(
    suite: SuiteGetter, backend: str, stage: int, path: str
) -> None:
    # fp16f: fused AdamW skips on the device (found_inf) and the host learns it a step late
    for rank, res in enumerate(suite("precision", 2, backend).ranks(f"{path}_s{stage}")):
        record = res["record"]
        assert [r["scale"] for r in record] == EXPECTED_SCALES, f"rank {rank}"
        assert [r["skipped"] for r in record] == list(
            torch.tensor(FP16_OVERFLOWS).cumsum(0).tolist()
        ), f"rank {rank}"
        assert [r["global_steps"] for r in record] == list(range(1, len(record) + 1))
        for i in range(1, len(record)):
            before, after = record[i - 1], record[i]
            if FP16_OVERFLOWS[i]:  # skipped: parameters, optimizer state and LR untouched
                assert torch.equal(before["masters"], after["masters"]), f"step {i}"
                assert torch.equal(before["opt"], after["opt"]), f"step {i}"
                assert before["lr"] == after["lr"], f"step {i}"
            else:
                assert not torch.equal(before["masters"], after["masters"]), f"step {i}"
                assert torch.isfinite(after["masters"]).all()


@pytest.mark.parametrize("path", ["bf16", "bf16f"], ids=["host-skip", "device-skip"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_non_finite_gradient_skips_the_step(
    suite: SuiteGetter, backend: str, stage: int, path: str
) -> None:
    for rank, res in enumerate(suite("precision", 2, backend).ranks(f"{path}_s{stage}")):
        record = res["record"]  # initial state, then after each of 4 steps; step 3 has a NaN
        assert [r["skipped"] for r in record] == [0, 0, 0, 1, 1], f"rank {rank}"
        assert torch.equal(record[2]["masters"], record[3]["masters"]), f"rank {rank}"
        assert torch.equal(record[2]["opt"], record[3]["opt"]), f"rank {rank}"
        for i in (1, 2, 4):
            assert not torch.equal(record[i - 1]["masters"], record[i]["masters"])
            assert torch.isfinite(record[i]["masters"]).all()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_non_finite_gradient_skips_on_the_device_and_holds_the_schedule(
    suite: SuiteGetter, backend: str, stage: int
) -> None:
    for rank, res in enumerate(suite("precision", 2, backend).ranks(f"fp32_s{stage}")):
        record = res["record"]  # initial state, then after each of 5 steps; step 3 has a NaN
        assert [r["skipped"] for r in record] == [0, 0, 0, 1, 1, 1], f"rank {rank}"
        assert torch.equal(record[2]["masters"], record[3]["masters"]), f"rank {rank}"
        assert torch.equal(record[2]["opt"], record[3]["opt"]), f"rank {rank}"
        assert record[2]["lr"] == record[3]["lr"], "a skipped step advanced the schedule"
        for i in (1, 2, 4, 5):
            assert not torch.equal(record[i - 1]["masters"], record[i]["masters"])
            assert torch.isfinite(record[i]["masters"]).all()
        lrs = [r["lr"] for r in record]  # WarmupLR's first step keeps warmup_min_lr
        assert lrs[0] == lrs[1] < lrs[2] == lrs[3] < lrs[4] < lrs[5], lrs
        # max_consecutive_skips 3: the third skip in a row stops training, one step late at
        # most (the verdict reaches the host at the next step or when read)
        assert res["stopped_at"] in (3, 4), res
        assert "3 consecutive steps (1–3)" in res["message"]
        assert "max_consecutive_skips" in res["message"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gathered_parameters_give_full_values_and_keep_the_modifier_ranks_edit(
    suite: SuiteGetter, backend: str, stage: int
) -> None:
    for rank, res in enumerate(suite("precision", 2, backend).ranks(f"gathered_s{stage}")):
        full = 10 * 10
        assert res["outside_numel"] == (0 if stage == 3 else full), f"rank {rank}"
        assert res["after_numel"] == (0 if stage == 3 else full), f"rank {rank}"
        for name, value in res["initial"].items():
            torch.testing.assert_close(res["inside"][name], value, rtol=0, atol=0)
        expected = torch.full((10, 10), 0.25)
        torch.testing.assert_close(res["edited"], expected, rtol=0, atol=0)
        torch.testing.assert_close(res["after_step"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_built_under_init_is_partitioned_and_trains_like_a_whole_one(
    suite: SuiteGetter, backend: str, stage: int
) -> None:
    for rank, res in enumerate(suite("precision", 2, backend).ranks(f"init_s{stage}")):
        assert res["placeholder_numels"] == [0], f"rank {rank}: parameters left whole"
        assert res["shard_numels"]["inp.weight"] == 16 * 8 // 2  # numel / world
        assert res["shard_numels"]["inp.bias"] == 16 // 2
        assert res["init"]["losses"] == res["whole"]["losses"], f"rank {rank}"
        for name, value in res["whole"]["state"].items():
            torch.testing.assert_close(res["init"]["state"][name], value, rtol=0, atol=0)
