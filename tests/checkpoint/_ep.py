"""Rank jobs for checkpoints of AutoEP engines (suites ``ep_save`` on 2 ranks, ``ep_w1`` on
1, ``ep_tp`` on 4).

The Mixtral-style model of ``tests/zero/_autoep.py`` (4 experts, top-2) trains 3 steps of 2
micro-batches at EP=2 (2 ranks, stage 1), saves both formats and trains 3 more (the
uninterrupted run). Fresh engines, perturbed so a load must overwrite every value, load each
format at the same layout and train the same 3 steps; the plain model (no AutoEP, 1 rank,
stage 0) loads each format too. ``ep_tp``: TP=2 × EP=2 on 4 ranks (stage 1) saves the
universal format (the native save is refused), then loads at the same layout, at EP=2 × DP=4
(no TP, stage 2) and at EP=4 (stage 1). Every job reports its losses and final parameters
under the reference model's names (global expert indices).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.zero import _autoep as A  # noqa: N812

STEPS = 3
GAS = 2
#: sequences per micro-batch of the global batch (the saving runs' DP size is 2)
GLOBAL_MICRO = 2 * A.MICRO


def global_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][micro] -> (idx, targets)`` of all 6 steps' global batches."""
    return A.batches(A.EPScenario(stage=0, world=2, gas=GAS, steps=2 * STEPS))


def engine_for(ep: int, tp: int, stage: int, perturb: bool = False) -> Any:
    """``ep`` = 0: the plain model without AutoEP."""
    import ds_core
    from ds_core import comm

    dp = comm.get_world_size() // tp
    model = A.build()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_MICRO // dp,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 400,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if ep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=A.optimizer(model.parameters()), config=cfg
    )
    return engine


def train(engine: Any, offset: int) -> list[float]:
    """Steps ``offset .. offset + STEPS``; this rank's loss of each micro-batch."""
    dp, dp_rank = engine.mesh.dp_size, engine.mesh.dp_rank
    per = GLOBAL_MICRO // dp
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = []
    for step in global_batches()[offset : offset + STEPS]:
        for idx, tgt in step:
            loss = engine(idx[sl], tgt[sl])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def state(engine: Any, ep: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's full (unsharded over DP and TP) fp32 masters and Adam moments under the
    reference's names: its own experts, by global index (collective)."""
    from ds_core.checkpoint._save import gather_param

    ep_rank = engine.mesh.dp_rank % max(ep, 1)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, zp in engine.zparams.items():
        st = engine.optimizer.state[zp.master]
        out[A.global_name(name, ep_rank, max(ep, 1))] = {
            "fp32": gather_param(engine, zp, zp.master).clone(),
            **{k: gather_param(engine, zp, st[k]).clone() for k in ("exp_avg", "exp_avg_sq")},
        }
    return out


def save(root: Path, ep: int, tp: int) -> dict[str, Any]:
    engine = engine_for(ep, tp, 1)
    train(engine, 0)
    folder = root / f"ep{ep}tp{tp}"
    try:
        engine.save_checkpoint(str(folder / "native"))
        native = "accepted"
    except Exception as exc:  # the message is the result
        native = f"{type(exc).__name__}: {exc}"
    engine.save_checkpoint(str(folder / "universal"), universal=True)
    out = {"native": native, "losses": train(engine, STEPS), "final": state(engine, ep)}
    engine.destroy()
    return out


def load(
    root: Path, saved: str, fmt: str, ep: int, tp: int, stage: int
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        engine = engine_for(ep, tp, stage, perturb=True)
        engine.load_checkpoint(str(root / saved / fmt))
        out = {
            "losses": train(engine, STEPS),
            "final": state(engine, ep),
            "steps": engine.global_steps,
        }
        engine.destroy()
        return out

    return run


def reference() -> dict[str, Any]:
    """6 steps of the plain model in one process (no engine): step losses, final parameters."""
    ref = A.run_reference(A.EPScenario(stage=0, world=2, gas=GAS, steps=2 * STEPS))
    return {"losses": ref["losses"], "params": ref["params"]}


def jobs(suite: str, root: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    if suite == "ep_save":
        return {
            "save": lambda: save(root, 2, 1),
            "ep2_native": load(root, "ep2tp1", "native", 2, 1, 1),
            "ep2_universal": load(root, "ep2tp1", "universal", 2, 1, 1),
        }
    if suite == "ep_w1":
        return {
            "reference": reference,
            "plain_native": load(root, "ep2tp1", "native", 0, 1, 0),
            "plain_universal": load(root, "ep2tp1", "universal", 0, 1, 0),
        }
    if suite == "ep_tp":
        return {
            "save": lambda: save(root, 2, 2),
            "tp2ep2_universal": load(root, "ep2tp2", "universal", 2, 2, 1),
            "ep2dp4_universal": load(root, "ep2tp2", "universal", 2, 1, 2),
            "ep4_universal": load(root, "ep2tp2", "universal", 4, 1, 1),
        }
    raise SystemExit(f"unknown suite {suite}")
