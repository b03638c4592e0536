"""The engine's contract on one rank: optimizer rejection, errors, the log line, zero_grad."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.zero.conftest import SuiteResults

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(suite: Callable[[str, int], SuiteResults]) -> dict[str, Any]:
    return suite("api", 1).ranks("api")[0]


@pytest.mark.parametrize("name", ["Muon", "WholeGradients"])
def test_optimizer_needing_whole_gradients_is_rejected_in_partitioned_stages(
    api: dict[str, Any], name: str
) -> None:
    assert api[f"{name}_s0"] == "accepted"
    for stage in (1, 2, 3):
        msg = api[f"{name}_s{stage}"]
        assert f"optimizer {name} needs whole gradients" in msg, msg
        assert f"stage {stage}" in msg and "stage 0" in msg and "AdamW" in msg, msg


def test_engine_without_optimizer_is_forward_only(api: dict[str, Any]) -> None:
    assert api["no_optimizer"].startswith("step() needs an optimizer"), api["no_optimizer"]


def test_log_line_every_steps_per_print(api: dict[str, Any]) -> None:
    lines = api["log"]
    assert [re.match(r"step=(\d+) ", line).group(1) for line in lines] == ["2", "4"]  # type: ignore[union-attr]
    for line in lines:
        for field in ("loss=", "lr=0.001", "loss_scale=65536", "grad_norm=", "skipped=0"):
            assert field in line, line
        assert re.search(r"mem_allocated=\d+(\.\d+)?MiB mem_peak=\d+(\.\d+)?MiB", line), line


def test_zero_grad_drops_accumulated_gradients(api: dict[str, Any]) -> None:
    assert api["zero_grad_equal"]


def test_training_data_and_scheduler_callable(api: dict[str, Any]) -> None:
    assert api["loader_sizes"] == [4, 4, 2]  # micro-batch 4 of 10 samples on one rank
    assert api["lr_after_step"] == pytest.approx(0.005)  # StepLR halved lr 1e-2 once
    assert api["returned_optimizer_is_engines"]


def test_stage3_allows_in_place_ops_on_module_outputs(api: dict[str, Any]) -> None:
    for got, want in api["inplace_relu_losses"]:
        assert got == pytest.approx(want, rel=1e-6)


def test_stage3_on_one_rank_gathers_without_collectives_and_matches_stage0(
    api: dict[str, Any],
) -> None:
    # A group of one: a stage-3 gather is a local copy (ds_core/zero/partition.py), not an
    # all-gather; training is bitwise that of stage 0.
    s0, s3 = api["one_rank"]["s0"], api["one_rank"]["s3"]
    assert s3["partitioned_units"] > 0
    assert s3["all_gathers"] == 0
    assert s3["losses"] == s0["losses"]
    assert s3["state"].keys() == s0["state"].keys()
    for name, value in s0["state"].items():
        assert torch.equal(s3["state"][name], value), name
