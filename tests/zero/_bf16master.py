"""bf16 master states (``bf16.bf16_master_weights_and_grads`` with ``bf16_optimizer_states``)
on 2 ranks, and the single-process reference that keeps the same dtypes.

The reference is plain PyTorch on the global batch with bf16 parameters that are their own
masters: each global micro-batch's backward accumulates bf16 gradients in bf16 (autograd's
``.grad``), the clip coefficient comes from an fp64 norm of those bf16 gradients (the engine's
``norm_dtype``), and AdamW's moments are bf16 (torch makes state in the parameter's dtype).
The engine differs only in where it rounds: each rank's gradient is bf16, the ranks' sum is
taken in fp32 (the default ``communication_data_type``) and rounded into the bf16 range once
per micro-batch, then averaged in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from tests.zero._common import (
    IN,
    MICRO,
    Scenario,
    TinyNet,
    batches,
    global_names,
    load_reference,
    make_optimizer,
    on_device,
    reference_state,
)

MASTER_KEYS = {
    "enabled": True,
    "bf16_master_weights_and_grads": True,
    "bf16_optimizer_states": True,
}

#: name -> scenario; each runs twice: bf16 masters (``m_<name>``) and fp32 masters
#: (``f_<name>``, the default bf16 training) for the drift.
SCENARIOS: dict[str, Scenario] = {
    "s1": Scenario(stage=1, world=2),
    "s2": Scenario(stage=2, world=2),
    "s3": Scenario(stage=3, world=2),
    "s1_gas1": Scenario(stage=1, world=2, gas=1),  # stage 1 without accumulation: streaming
    "s2_overlap": Scenario(stage=2, world=2, overlap=True),
    "s3_persist": Scenario(stage=3, world=2, threshold=100, bucket=10_000),
}


def config(sc: Scenario, masters: bool) -> dict[str, Any]:
    cfg = sc.config()
    cfg["bf16"] = dict(MASTER_KEYS) if masters else {"enabled": True}
    return cfg


def train(sc: Scenario, masters: bool) -> dict[str, Any]:
    import ds_core
    from ds_core import comm

    rank = comm.get_rank()
    torch.manual_seed(1234 + rank)  # differs per rank: the engine broadcasts rank 0's
    model = TinyNet(sc.ep_size)
    if rank == 0:
        load_reference(model, reference_state())
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=make_optimizer(model.parameters()), config=config(sc, masters)
    )
    losses, norms = [], []
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in batches(sc.steps, sc.gas, sc.world):
        for x, y in step:
            out = engine(on_device(x[sl].bfloat16()))
            loss = F.mse_loss(out.float(), on_device(y[sl]))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.last_grad_norm)
    masters_ = [zp.master for zp in engine._trainable if zp.master is not None]
    state_dtypes = sorted(
        {
            str(v.dtype)
            for st in engine.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1
        }
    )
    grads = [ug.reduced for ug in engine.reducer.units if ug.reduced is not None]
    grads += [ug.local for ug in engine.reducer.units if ug.local is not None]
    info = {
        "master_dtypes": sorted({str(m.dtype) for m in masters_}),
        "state_dtypes": state_dtypes,
        "grad_dtypes": sorted({str(g.dtype) for g in grads}),
        "bytes": engine.model_state_bytes(),
    }
    engine.eval()
    probe = torch.randn(6, IN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eval_out = engine(on_device(probe.bfloat16()))
    state = global_names(model, engine.gathered_state_dict())
    engine.destroy()
    return {"losses": losses, "norms": norms, "state": state, "eval_out": eval_out, **info}


def reference(sc: Scenario) -> dict[str, Any]:
    """Single process, same dtypes: bf16 parameters as their own masters, bf16 gradients
    accumulated in bf16 over the micro-batches, fp64 norm, AdamW with bf16 state."""
    model = TinyNet(1)
    model.load_state_dict(reference_state())
    model.to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(trainable)
    losses, norms = [], []
    for step in batches(sc.steps, sc.gas, sc.world):
        for x, y in step:  # one global micro-batch: every rank's samples
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            (loss / sc.gas).backward()
            with torch.no_grad():  # rank 0's loss, as the engine logs it per rank
                out0 = model(x[:MICRO].bfloat16()).float()
                losses.append(F.mse_loss(out0, y[:MICRO]).item())
        for p in trainable:
            if p.grad is None:  # the engine's contract: no gradient means zeros
                p.grad = torch.zeros_like(p)
        norm = torch.stack([p.grad.double().square().sum() for p in trainable]).sum().sqrt()
        if sc.clip > 0:
            coef = (sc.clip / (norm + 1e-6)).clamp(max=1.0).float()
            for p in trainable:
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        norms.append(float(norm))
    state_dtypes = sorted(
        {str(v.dtype) for st in opt.state.values() for v in st.values() if v.numel() > 1}
    )
    probe = torch.randn(6, IN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eval_out = model(probe.bfloat16())
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "state_dtypes": state_dtypes,
        "eval_out": eval_out,
    }


def jobs(world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {}
    for name, sc in SCENARIOS.items():
        out[f"m_{name}"] = lambda sc=sc: train(sc, masters=True)
        out[f"f_{name}"] = lambda sc=sc: train(sc, masters=False)
    return out
