"""Rank-side jobs: the ZeRO engine (stage 0) training with the compressing optimizers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_core
from ds_core.comm import get_rank, get_world_size

WIDTH, MICRO = 8, 4


def model(seed: int = 0) -> nn.Module:
    """The tiny MLP every job and reference starts from (same weights on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of ``step``, drawn on the host."""
    g = torch.Generator().manual_seed(7919 * step + 101 * rank + micro)
    return torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, 3, generator=g)


def train(
    config: dict[str, Any], steps: int, save_at: int | None = None, ckpt: str = ""
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; the parameters after each step (host, by name), the
    ``backward_allreduce`` seen before each step, and the step's reported gradient norm.
    With ``save_at``, save a checkpoint to ``ckpt`` after that step; a run whose config
    carries ``"_load": true`` loads it first and trains ``steps`` more."""
    cfg = dict(config)
    load = cfg.pop("_load", False)
    engine, *_ = ds_core.zero.initialize(model=model(), config=cfg)
    rank, world = get_rank(), get_world_size()
    assert world >= 1
    first = 0
    if load:
        engine.load_checkpoint(ckpt)
        first = engine.global_steps
    params, flags = [], []
    for step in range(first, first + steps):
        flags.append(bool(getattr(engine.optimizer, "backward_allreduce", True)))
        for micro in range(engine.gas):
            x, y = batch(rank, step, micro)
            dev = engine.device
            loss = torch.nn.functional.mse_loss(engine(x.to(dev)), y.to(dev))
            engine.backward(loss)
            engine.step()
        params.append(
            {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
        )
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(ckpt)
    engine.destroy()
    return {"params": params, "flags": flags}
