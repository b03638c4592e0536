"""Rank-side jobs for tests/zero/test_torch_style_backward.py: the ZeRO engine trained with
PyTorch-style ``loss.backward()`` (DeepSpeed 0.19) against ``engine.backward(loss)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_core
from ds_core.comm import get_rank

WIDTH, OUT, MICRO = 8, 3, 4
Params = dict[str, torch.Tensor]


def model(seed: int = 0) -> nn.Module:
    """The tiny MLP every run starts from (same weights on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT))


def config(stage: int, gas: int, fp16: bool) -> dict[str, Any]:
    """ZeRO ``stage``, ``gas`` micro-batches per step, clipping 1.0, fp16 or fp32."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": fp16, "initial_scale_power": 8},
    }


def batch(engine: Any, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch ``micro`` of ``step``, drawn on the host, on the device."""
    g = torch.Generator().manual_seed(7919 * step + 101 * get_rank() + micro)
    x, y = torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, OUT, generator=g)
    return x.to(engine.device, engine.module[0].weight.dtype), y.to(engine.device)


def params(engine: Any) -> Params:
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def torch_backward(engine: Any, loss: torch.Tensor, retain_graph: bool = False) -> None:
    """The PyTorch-style backward: ``engine.scale(loss).backward()`` under fp16."""
    scaled = engine.scale(loss) if engine.fp16 else loss
    scaled.backward(retain_graph=retain_graph)


def train(stage: int, gas: int, fp16: bool, styles: str, steps: int = 3) -> dict[str, Any]:
    """Train ``steps`` steps; micro-batch ``m`` backpropagates with ``engine.backward`` when
    ``styles[m]`` is ``"e"``, with ``loss.backward()`` when ``"t"``. The parameters after each
    step, and ``_loss_count`` after each backward."""
    engine, *_ = ds_core.zero.initialize(model=model(), config=config(stage, gas, fp16))
    trace, counts = [], []
    for step in range(steps):
        for micro in range(gas):
            x, y = batch(engine, step, micro)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            if styles[micro] == "e":
                engine.backward(loss)
            else:
                torch_backward(engine, loss)
            counts.append(engine._loss_count)
            engine.step()
        trace.append(params(engine))
    engine.destroy()
    return {"params": trace, "counts": counts}


def compare(stage: int, gas: int, fp16: bool) -> dict[str, Any]:
    """Every micro-batch with ``engine.backward``, then every one with ``loss.backward()``."""
    return {
        "engine": train(stage, gas, fp16, "e" * gas),
        "torch": train(stage, gas, fp16, "t" * gas),
    }


def mixed(stage: int, fp16: bool) -> dict[str, Any]:
    """One window of 3 micro-batches mixing both, against ``engine.backward`` only."""
    return {"engine": train(stage, 3, fp16, "eee"), "mixed": train(stage, 3, fp16, "ete")}


def two_losses(stage: int, fp16: bool, style: str) -> dict[str, Any]:
    """Two losses from one forward per micro-batch, each backpropagated (``retain_graph``)."""
    engine, *_ = ds_core.zero.initialize(model=model(), config=config(stage, 1, fp16))
    trace, counts = [], []
    for step in range(3):
        x, y = batch(engine, step, 0)
        out = engine(x).float()
        first, second = nn.functional.mse_loss(out, y), out.abs().mean()
        if style == "e":
            engine.backward(first, retain_graph=True)
            engine.backward(second)
        else:
            torch_backward(engine, first, retain_graph=True)
            torch_backward(engine, second)
        counts.append(engine._loss_count)
        engine.step()
        trace.append(params(engine))
    engine.destroy()
    return {"params": trace, "counts": counts}


def boundary_two_losses(stage: int) -> dict[str, Any]:
    """Accumulation 2; the window's last micro-batch backpropagates two losses of one forward
    (two reducing backwards in one window), fp32."""
    engine, *_ = ds_core.zero.initialize(model=model(), config=config(stage, 2, False))
    trace = []
    for step in range(3):
        x, y = batch(engine, step, 0)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()  # not a boundary
        x, y = batch(engine, step, 1)
        out = engine(x)
        engine.backward(nn.functional.mse_loss(out, y), retain_graph=True)
        engine.backward(out.abs().mean())
        engine.step()
        trace.append(params(engine))
    engine.destroy()
    return {"params": trace}


def fp16_unscaled(stage: int) -> dict[str, Any]:
    """fp16: a plain ``loss.backward()`` without ``scale`` raises and changes nothing; the
    engine trains on after it."""
    engine, *_ = ds_core.zero.initialize(model=model(), config=config(stage, 1, True))
    x, y = batch(engine, 0, 0)
    message = ""
    try:
        nn.functional.mse_loss(engine(x).float(), y).backward()  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        message = str(exc)
    after = {
        "count": engine._loss_count,
        "in_backward": engine._in_backward,
        "grads": [p.grad is not None for p in engine.module.parameters()],
    }
    before = params(engine)
    loss = nn.functional.mse_loss(engine(x).float(), y)
    engine.scale(loss).backward()  # type: ignore[no-untyped-call]
    engine.step()
    moved = any(not torch.equal(before[k], v) for k, v in params(engine).items())
    engine.destroy()
    return {"message": message, "after": after, "moved": moved}


class TwoHeads(nn.Module):
    """Returns the model's output and a branch of the input that reaches no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x.sin()


def no_parameter() -> dict[str, Any]:
    """A plain backward through an output that reaches no trainable parameter raises at the
    end of the backward; the engine's next backward is a normal one."""
    engine, *_ = ds_core.zero.initialize(model=TwoHeads(), config=config(0, 1, False))
    x = torch.randn(MICRO, WIDTH, device=engine.device, requires_grad=True)
    message = ""
    try:
        engine(x)[1].sum().backward()
    except RuntimeError as exc:
        message = str(exc)
    state = (engine._backward_kind, engine._in_backward)
    engine(x)[0].sum().backward()
    engine.step()
    engine.destroy()
    return {"message": message, "state": state}


def gan(stage: int, style: str) -> dict[str, Any]:
    """A generator loss computed from the discriminator *engine*'s output, backpropagated
    with ``G_engine.backward(errG)`` (``style`` "e") or ``errG.backward()`` ("t"): what each
    engine counted, whether the discriminator's gradients stayed on ``p.grad``, and the
    gradient that reached the generator's output against plain torch."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(4, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    net_d = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    ref_g, ref_d = [m.state_dict() for m in (net_g, net_d)]
    ref_g = {k: v.clone() for k, v in ref_g.items()}
    ref_d = {k: v.clone() for k, v in ref_d.items()}
    cfg = config(stage, 3, False)
    eng_d, *_ = ds_core.zero.initialize(model=net_d, config=cfg)
    eng_g, *_ = ds_core.zero.initialize(model=net_g, config=cfg)
    z = torch.randn(MICRO, 4, generator=torch.Generator().manual_seed(get_rank()))
    fake = eng_g(z.to(eng_g.device))
    seen: list[torch.Tensor] = []
    fake.register_hook(lambda g: seen.append(g.detach().cpu().clone()))
    err_g = eng_d(fake).pow(2).mean()
    if style == "e":
        eng_g.backward(err_g)
    else:
        err_g.backward()
    # Plain torch: the gradient of err_g at the generator's output, unscaled.
    plain_g = nn.Sequential(nn.Linear(4, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    plain_d = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    plain_g.load_state_dict(ref_g)
    plain_d.load_state_dict(ref_d)
    out = plain_g(z)
    (ref,) = torch.autograd.grad(plain_d(out).pow(2).mean(), out)
    result = {
        "d_count": eng_d._loss_count,
        "g_count": eng_g._loss_count,
        "d_grads_on_params": [p.grad is not None for p in net_d.parameters()],
        "ratio": float((seen[0] / ref).mean()),
    }
    eng_g.destroy()
    eng_d.destroy()
    return result
