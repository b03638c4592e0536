"""Activation checkpointing (``ds_core.checkpointing``) on a device: the GPT example's gradients
with and without checkpointing, and a dropout layer's recomputation, on the selected backend's
device. Used in-process on cpu by tests/compat/test_checkpointing.py and, through
:func:`run_job`, on a one-rank pool of each other backend (tests/rankpool.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.gpt import GPT, PRESETS
from tests.zero._common import to_host

#: the ``activation_checkpointing`` sections every case runs under
SECTIONS: list[dict[str, Any]] = [
    {},
    {"cpu_checkpointing": True},
    {"synchronize_checkpoint_boundary": True, "profile": True},
    {"partition_activations": True, "contiguous_memory_optimization": True},
]


def gpt_grads(ckpt: bool, device: torch.device | str = "cpu") -> tuple[float, dict[str, Any]]:
    """The tiny GPT's loss and gradients (on ``device``), each block checkpointed if ``ckpt``;
    data drawn on the host, so every device sees the same."""
    from ds_core import checkpointing

    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).to(device)
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    tgt = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)
    x = model.wte(idx) + model.wpe(torch.arange(16, device=device))
    for block in model.blocks:
        x = checkpointing.checkpoint(block, x) if ckpt else block(x)
    logits = model.lm_head(model.ln_f(x))
    loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def dropout_grads(ckpt: bool, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Gradients of a layer with dropout between two linears, seeded the same way each call:
    checkpointed, the recomputation must draw the forward's masks from the device's generator."""
    from ds_core import checkpointing

    torch.manual_seed(5)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).to(device)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(6)).to(device)
    torch.manual_seed(3)  # every device's generator
    out = checkpointing.checkpoint(layer, x) if ckpt else layer(x)
    out.sum().backward()
    return [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]


def run_job() -> dict[str, Any]:
    """Per section of :data:`SECTIONS`: GPT losses and gradients with and without
    checkpointing, and the dropout layer's, on this rank's device; on the host."""
    import ds_core
    from ds_core import checkpointing

    device = ds_core.get_accelerator().device()
    out: dict[str, Any] = {"device": str(device)}
    try:
        for i, section in enumerate(SECTIONS):
            checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
            out[f"gpt{i}"] = {"plain": gpt_grads(False, device), "ckpt": gpt_grads(True, device)}
            out[f"dropout{i}"] = {
                "plain": dropout_grads(False, device),
                "ckpt": dropout_grads(True, device),
            }
    finally:
        checkpointing.reset()
    return to_host(out)  # type: ignore[no-any-return]
