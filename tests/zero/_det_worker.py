"""Rank job of the determinism tests (:func:`run_jobs`, on a rank pool: tests/rankpool.py).

Per stage, three 20-step trainings of the tiny model (MoE, tied and frozen weights, dropout,
data drawn from torch's global generator during training, clipping, accumulation): two under
the config's deterministic policy, each started from a differently scrambled generator state,
and one without the policy. Data is drawn on the host and trained on the backend's device, so
on an accelerator the dropout masks come from the device's generator (the policy must seed
it). Each rank saves ``OUTDIR/det.rank<r>.pt``, on the host.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from tests.zero._common import (
    IN,
    MICRO,
    OUT,
    Scenario,
    TinyNet,
    load_reference,
    on_device,
    reference_state,
    to_host,
)

STEPS = 20


class DropoutNet(TinyNet):
    """The tiny model with dropout on its input: training draws from the host generator."""

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(F.dropout(x, 0.2, training=self.training), extra)


def train(stage: int, ep_size: int, deterministic: bool, scramble: int) -> dict[str, Any]:
    import ds_core
    from ds_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    # Whatever ran before leaves the generators somewhere else: the policy must not care.
    torch.manual_seed(scramble)
    random.seed(scramble)
    model = DropoutNet(ep_size)
    load_reference(model, reference_state())
    cfg = Scenario(stage=stage, world=world, ep_size=ep_size).config()
    if deterministic:
        cfg["deterministic"] = {"enabled": True, "seed": 1234}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
    out: dict[str, Any] = {
        "policy_on": torch.are_deterministic_algorithms_enabled(),
        "knobs": sorted(engine.determinism.knobs()) if engine.determinism is not None else [],
    }
    losses = []
    for _ in range(STEPS * engine.gas):
        x = torch.randn(world * MICRO, IN)[rank * MICRO : (rank + 1) * MICRO]
        y = torch.randn(world * MICRO, OUT)[rank * MICRO : (rank + 1) * MICRO]
        loss = F.mse_loss(engine(on_device(x)), on_device(y))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    out["losses"] = torch.stack(losses)
    out["params"] = {k: v.clone() for k, v in engine.gathered_state_dict().items()}
    out["optim"] = engine.optimizer.state_dict()
    engine.destroy()
    out["policy_after_destroy"] = torch.are_deterministic_algorithms_enabled()
    return out


def train_gpt(stage: int, deterministic: bool, scramble: int) -> dict[str, Any]:
    """The GPT example (tiny preset), built after the policy is enabled so its
    initialisation is seeded too; tokens are drawn from torch's generator during training."""
    import ds_core
    from ds_core import comm, determinism
    from examples.gpt import GPT, PRESETS

    torch.manual_seed(scramble)
    cfg = PRESETS["tiny"]
    policy = determinism.enable(99) if deterministic else None
    try:
        model = GPT(cfg)
        engine, _, _, _ = ds_core.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            config={
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000},
            },
        )
        rank, world = comm.get_rank(), comm.get_world_size()
        losses = []
        for _ in range(STEPS * engine.gas):
            tokens = on_device(torch.randint(0, cfg.vocab_size, (world, 33))[rank : rank + 1])
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        out = {
            "losses": torch.stack(losses),
            "params": {k: v.clone() for k, v in engine.gathered_state_dict().items()},
            "optim": engine.optimizer.state_dict(),
        }
        engine.destroy()
    finally:
        if policy is not None:
            policy.disable()
    return out


def jobs() -> dict[str, dict[str, Any]]:
    out = {}
    for stage in range(4):
        out[f"gpt_s{stage}"] = {
            "det_a": train_gpt(stage, True, scramble=11),
            "det_b": train_gpt(stage, True, scramble=22),
            "plain": train_gpt(stage, False, scramble=33),
        }
    for stage, ep in ((0, 1), (1, 1), (2, 1), (3, 1), (3, 2)):
        name = f"s{stage}" + ("_ep2" if ep > 1 else "")
        out[name] = {
            "det_a": train(stage, ep, True, scramble=11),
            "det_b": train(stage, ep, True, scramble=22),
            "plain": train(stage, ep, False, scramble=33),
        }
    return out


def run_jobs(outdir: str) -> None:
    """Every training of :func:`jobs` on this rank; the results, on the host, in
    ``OUTDIR/det.rank<r>.pt``."""
    from ds_core import comm

    torch.save(to_host(jobs()), os.path.join(outdir, f"det.rank{comm.get_rank()}.pt"))
