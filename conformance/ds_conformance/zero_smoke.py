"""ZeRO smoke runs: a tiny model trained on 2 ranks at stages 0-3 through the backend.

Each rank trains the same model (built from one seed; the engine also broadcasts rank 0's
parameters) with ``ds_core.initialize`` on its half of every global batch, so all traffic goes
through the backend's own collectives, and compares against single-process torch trained on
the whole batch, computed in the same rank from the same seeds. The model has odd layer sizes
(7 → 12 → 3: 135 parameters, split unevenly across ranks and padded), a bias and a
``Tanh``; training is fp32 AdamW with gradient clipping that engages.

Tolerance: 1e-5 relative with an absolute floor of 1e-6 for parameters and losses
(docs/architecture.md §3.12: "matches" means 1e-5 relative in fp32; the floor covers elements
near zero, where AdamW's division by ``sqrt(v)`` amplifies reduction-order rounding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

WORLD = 2
STAGES: tuple[int, ...] = (0, 1, 2, 3)
STEPS = 3
MICRO = 3  # samples per rank per step (global batch: 6)
RTOL, ATOL = 1e-5, 1e-6
CLIP = 0.5  # below the first steps' gradient norm, so clipping changes the update


def key(stage: int) -> str:
    return f"zero[stage{stage}]"


def _model() -> torch.nn.Module:
    torch.manual_seed(20240)
    return torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [
        (torch.randn(WORLD * MICRO, 7, generator=gen), torch.randn(WORLD * MICRO, 3, generator=gen))
        for _ in range(STEPS)
    ]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Single-process torch on the global batch: per-rank losses per step, final parameters."""
    model = _model()
    opt = _optimizer(model.parameters())
    losses: list[list[float]] = []
    for x, y in _batches():
        out = model(x)
        losses.append(
            [
                F.mse_loss(out[r * MICRO : (r + 1) * MICRO], y[r * MICRO : (r + 1) * MICRO]).item()
                for r in range(WORLD)
            ]
        )
        opt.zero_grad()
        F.mse_loss(out, y).backward()  # type: ignore[no-untyped-call]  # equal micro-batches: the mean of the ranks' means
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(acc: Any, rank: int, stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """This rank's losses and the final full parameters after training at ``stage``."""
    import ds_core
    from ds_core.zero import GatheredParameters

    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=_optimizer(model.parameters()), config=config
    )
    device = acc.device()
    losses = []
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for x, y in _batches():
        loss = F.mse_loss(engine(x[sl].to(device)), y[sl].to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = list(model.parameters())
    with GatheredParameters(params):
        final = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return losses, final


def compare(
    stage: int,
    rank: int,
    losses: list[float],
    params: dict[str, torch.Tensor],
    ref: tuple[list[list[float]], dict[str, torch.Tensor]],
) -> str:
    """The empty string when the run matches the reference, else its first difference."""
    ref_losses, ref_params = ref
    expected = [step[rank] for step in ref_losses]
    got, want = torch.tensor(losses, dtype=torch.float64), torch.tensor(expected)
    if not torch.allclose(got, want.double(), rtol=RTOL, atol=ATOL):
        return (
            f"rank {rank} losses={losses}, but should be {expected} within rtol {RTOL} "
            f"[initialize(stage={stage}) vs single-process torch]"
        )
    if set(params) != set(ref_params):
        return f"rank {rank} parameter names={sorted(params)}, but should be {sorted(ref_params)}"
    for name, want_p in ref_params.items():
        got_p = params[name]
        if got_p.shape != want_p.shape or not torch.allclose(got_p, want_p, rtol=RTOL, atol=ATOL):
            worst = (got_p.reshape(-1) - want_p.reshape(-1)).abs().max().item()
            return (
                f"rank {rank} parameter {name} after {STEPS} steps differs by up to {worst:.3g}, "
                f"but should match single-process torch within rtol {RTOL}, atol {ATOL} "
                f"[initialize(stage={stage})]"
            )
    return ""


def run_all(acc: Any, rank: int) -> dict[str, str]:
    """Train at every stage; result key -> "" or the failure."""
    import traceback

    ref = reference()
    out: dict[str, str] = {}
    for stage in STAGES:
        try:
            losses, params = train(acc, rank, stage)
            out[key(stage)] = compare(stage, rank, losses, params, ref)
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            out[key(stage)] = (
                f"rank {rank} initialize(stage={stage}) raised {type(exc).__name__}: {exc} "
                f"({last.name}:{last.lineno})"
            )
    return out
