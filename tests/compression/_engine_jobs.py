"""Rank-side jobs: the ZeRO engine (stage 0) training with the compressing optimizers."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import ds_core
from ds_core.comm import get_rank, get_world_size
from ds_core.hookspecs._markers import hookimpl

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
    config: dict[str, Any],
    steps: int,
    save_at: int | None = None,
    ckpt: str = "",
    poison: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; the parameters after each step (host, by name), the
    ``backward_allreduce`` seen before each step, and the skipped-step count at the end.
    With ``save_at``, save a checkpoint to ``ckpt`` after that step; a run whose config
    carries ``"_load": true`` loads it first and trains ``steps`` more. ``poison``
    ``(rank, step)``: that rank's inputs of that step are inf (its gradients overflow)."""
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
            if poison == (rank, step):
                x = torch.full_like(x, float("inf"))
            dev = engine.device
            x = x.to(dev, engine.module[0].weight.dtype)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y.to(dev))
            engine.backward(loss)
            engine.step()
        params.append(
            {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
        )
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(ckpt)
    skipped = engine.skipped_steps
    engine.destroy()
    return {"params": params, "flags": flags, "skipped": skipped}


class GroupBytes:
    """A wrapper plugin recording ``(group size, logical bytes)`` of every all-gather."""

    def __init__(self) -> None:
        self.records: list[tuple[int, int]] = []

    @hookimpl(wrapper=True)
    def ds_comm_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
    ) -> Any:
        self.records.append((get_world_size(group), output.numel() * output.element_size()))
        return (yield)


def zeropp(extra: dict[str, Any], steps: int, local_size: int) -> dict[str, Any]:
    """Stage 3 on the GPT-like stack below with ZeRO++ keys ``extra``, on nodes of
    ``local_size`` ranks: losses, final parameters (gathered, host) and the all-gathers'
    ``(group size, bytes)`` per step."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_size)
    torch.manual_seed(0)
    net = nn.Sequential(
        *(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)), nn.Linear(64, 3)
    )
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            **extra,
        },
    }
    engine, *_ = ds_core.zero.initialize(model=net, config=cfg)
    spy = GroupBytes()
    ds_core.register_plugin(spy)
    rank, losses, gathers = get_rank(), [], []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(7919 * step + rank)
            x, y = torch.randn(MICRO, 64, generator=g), torch.randn(MICRO, 3, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            gathers.append(list(spy.records))
            spy.records.clear()
    finally:
        ds_core.unregister_plugin(spy)
        del os.environ["LOCAL_WORLD_SIZE"]
    with ds_core.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "gathers": gathers}


def manual(config: dict[str, Any], steps: int) -> dict[str, Any]:
    """What :func:`train` must equal: the config's optimizer (``build_optimizer``) on this
    rank's replica, fed gradients averaged over the ranks while it asks for that
    (``backward_allreduce``) and its own otherwise."""
    from ds_core.zero.compat.builders import build_optimizer
    from ds_core.zero.config import OptimizerConfig

    device = ds_core.get_accelerator().device()
    net = model().to(device)
    opt = build_optimizer(OptimizerConfig(**config["optimizer"]), list(net.parameters()))
    rank, world = get_rank(), get_world_size()
    params, flags = [], []
    gas = int(config.get("gradient_accumulation_steps", 1))
    for step in range(steps):
        flag = bool(getattr(opt, "backward_allreduce", True))
        flags.append(flag)
        for micro in range(gas):
            x, y = batch(rank, step, micro)
            loss = torch.nn.functional.mse_loss(net(x.to(device)), y.to(device))
            (loss / gas).backward()
        if flag and world > 1:
            for p in net.parameters():
                ds_core.comm.all_reduce(p.grad, "sum")
                p.grad.mul_(1.0 / world)
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().float().cpu().clone() for n, p in net.named_parameters()})
    return {"params": params, "flags": flags}
