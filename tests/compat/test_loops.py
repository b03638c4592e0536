"""DeepSpeed client programs, unchanged but for ``import ds_core as deepspeed``, against plain
PyTorch on the global batch: final weights within 1e-6 at ZeRO stages 0-3 on 2 ranks of each
backend of tests/compat/conftest.py's ``COMPAT_BACKENDS`` (cpu, sim), the same references and
tolerance on each. ``torch_autocast`` runs where the device autocasts (cpu); on sim, which
registers no autocast, initialize refuses it on every rank rather than train in fp32."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.compat import _loops
from tests.compat.conftest import WORLD

TOL = 1e-6
STAGES = [0, 1, 2, 3]


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), rtol=0, atol=TOL, msg=key)


@pytest.mark.parametrize("stage", STAGES)
def test_simple_model_loop(loops: list[dict[str, Any]], stage: int) -> None:
    want = _loops.simple_reference(WORLD)["state"]
    for rank in range(WORLD):
        assert_state_close(loops[rank][f"simple_s{stage}"]["state"], want)


@pytest.mark.parametrize("stage", STAGES)
def test_load_state_dict_writes_shards_and_masters(loops: list[dict[str, Any]], stage: int) -> None:
    want = _loops.simple_reference(WORLD)["state"]
    for rank in range(WORLD):
        assert_state_close(loops[rank][f"simple_load_s{stage}"]["state"], want)


@pytest.mark.parametrize("stage", STAGES)
def test_cifar_loop_with_args_and_deepspeed_loader(loops: list[dict[str, Any]], stage: int) -> None:
    ref = _loops.cifar_reference(WORLD)
    for rank in range(WORLD):
        got = loops[rank][f"cifar_s{stage}"]
        # dataloader_drop_last: 19 samples per rank make 4 full batches of 4, the 3 left dropped
        assert got["batches"] == ref["batches"] == 4
        assert_state_close(got["state"], ref["state"])


@pytest.mark.parametrize("stage", STAGES)
def test_gan_loop_two_engines(loops: list[dict[str, Any]], stage: int) -> None:
    """The generator's backward flows through the discriminator; the script's
    ``netD.zero_grad()`` must discard those gradients, as plain PyTorch's does."""
    ref = _loops.gan_reference(WORLD)
    for rank in range(WORLD):
        got = loops[rank][f"gan_s{stage}"]
        assert_state_close(got["D"], ref["D"])
        assert_state_close(got["G"], ref["G"])
    for key in ("d_losses", "g_losses"):
        mean = [
            sum(r[f"gan_s{stage}"][key][i] for r in loops) / WORLD for i in range(len(ref[key]))
        ]
        assert mean == pytest.approx(ref[key], abs=TOL)


def test_no_sync_accumulates_without_reducing(loops: list[dict[str, Any]]) -> None:
    want = _loops.nosync_reference(WORLD)["state"]
    for rank in range(WORLD):
        assert_state_close(loops[rank]["nosync_s0"]["state"], want)


@pytest.mark.parametrize("stage", STAGES)
def test_torch_autocast_forward(loops: list[dict[str, Any]], stage: int) -> None:
    device = loops[0]["backend"].partition("-")[0]
    if device == "sim":  # no autocast kernels: torch would disable the context with a warning
        for rank in range(WORLD):
            msg = loops[rank][f"autocast_s{stage}"].get("refused", "trained")
            assert "torch_autocast.dtype bfloat16" in msg and "'sim' backend" in msg, msg
            assert "silently run in full precision" in msg, msg
        return
    want = _loops.autocast_reference(WORLD)["state"]
    for rank in range(WORLD):
        assert_state_close(loops[rank][f"autocast_s{stage}"]["state"], want)
