"""ds_core.checkpointing: DeepSpeed's configure()/checkpoint() on torch.utils.checkpoint;
gradients equal to no checkpointing within 1e-6 on the GPT example (single process, cpu), and
the same on the simulated accelerator's device (a one-rank pool, :data:`ACT_BACKENDS`): there
the saved inputs of ``cpu_checkpointing`` leave the device and come back, and the recomputed
dropout masks come from the device's generator."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ds_core import ConfigError, checkpointing
from ds_core.zero.config import load_config
from tests.compat._act_ckpt import SECTIONS, gpt_grads
from tests.rankpool import RankPools
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

TOL = 1e-6
#: the backends other than cpu (which the in-process tests cover): sim in one async mode (the
#: recomputation runs in autograd's order, which the mode does not change).
ACT_BACKENDS = [b for b in installed_backends() if b == "sim-threads"]


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    checkpointing.reset()
    yield
    checkpointing.reset()


@pytest.mark.parametrize("section", SECTIONS)
def test_gradients_equal_no_checkpointing(section: dict[str, Any]) -> None:
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
    loss, grads = gpt_grads(ckpt=False)
    loss_ck, grads_ck = gpt_grads(ckpt=True)
    assert loss_ck == pytest.approx(loss, abs=TOL)
    for name, g in grads.items():
        torch.testing.assert_close(grads_ck[name], g, rtol=0, atol=TOL, msg=name)


def test_recomputation_draws_the_same_dropout_masks() -> None:
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    layer(x).sum().backward()
    want = [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]
    layer.zero_grad()
    torch.manual_seed(3)
    checkpointing.checkpoint(layer, x).sum().backward()
    for p, g in zip(layer.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=TOL)


def test_configure_reads_the_section_then_keyword_overrides() -> None:
    cfg = {"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4}}
    checkpointing.configure(None, deepspeed_config=cfg, profile=True)
    s = checkpointing.settings()
    assert (s.cpu_checkpointing, s.number_checkpoints, s.profile) == (True, 4, True)
    assert checkpointing.is_configured()
    assert load_config(cfg, 1).activation_checkpointing.number_checkpoints == 4


def test_profile_logs_each_checkpointed_forward(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.configure(None, profile=True)
    with caplog.at_level(logging.INFO, logger="ds_core.checkpointing"):
        checkpointing.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True))
    assert any("checkpoint Linear forward:" in r.getMessage() for r in caplog.records)


def test_refusals_name_the_reason() -> None:
    with pytest.raises(ConfigError, match="model parallelism is not supported"):
        checkpointing.configure(object())
    with pytest.raises(ConfigError, match="contiguous_memory_optimization needs"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.profile"):
        load_config({"activation_checkpointing": {"profile": "yes"}}, 1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ACT_BACKENDS)
def test_on_the_device_gradients_and_dropout_masks_equal_no_checkpointing(
    rank_pools: RankPools, backend: str
) -> None:
    r = rank_pools.get(1, backend_env(backend, 1)).run("tests.compat._act_ckpt:run_job")[0]
    assert r["device"].startswith(backend.partition("-")[0])
    host_loss, host_grads = gpt_grads(ckpt=False)  # the single-process host reference
    for i, section in enumerate(SECTIONS):
        (loss, grads), (loss_ck, grads_ck) = r[f"gpt{i}"]["plain"], r[f"gpt{i}"]["ckpt"]
        assert loss_ck == pytest.approx(loss, abs=TOL), section
        assert loss == pytest.approx(host_loss, abs=TOL), section
        for name, g in grads.items():
            torch.testing.assert_close(grads_ck[name], g, rtol=0, atol=TOL, msg=name)
            torch.testing.assert_close(g, host_grads[name], rtol=0, atol=TOL, msg=name)
        drop = r[f"dropout{i}"]
        for got, want in zip(drop["ckpt"], drop["plain"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
