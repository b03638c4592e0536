"""ds_core.checkpointing: DeepSpeed's configure()/checkpoint() on torch.utils.checkpoint;
gradients equal to no checkpointing within 1e-6 on the GPT example (single process, cpu)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_core import ConfigError, checkpointing
from ds_core.zero.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, PRESETS

TOL = 1e-6


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    checkpointing.reset()
    yield
    checkpointing.reset()


def gpt_grads(ckpt: bool) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(2))
    x = model.wte(idx) + model.wpe(torch.arange(16))
    for block in model.blocks:
        x = checkpointing.checkpoint(block, x) if ckpt else block(x)
    logits = model.lm_head(model.ln_f(x))
    loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "section",
    [
        {},
        {"cpu_checkpointing": True},
        {"synchronize_checkpoint_boundary": True, "profile": True},
        {"partition_activations": True, "contiguous_memory_optimization": True},
    ],
)
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
