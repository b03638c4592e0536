"""Rank jobs for checkpoints of NVMe-resident optimizer state (suites ``nvme_save``,
``nvme_load``, 2 ranks).

``nvme_save``: at stages 1-3, an engine with ``offload_optimizer.device = "nvme"`` (sub-groups
of 37 elements, so parameters are cut across sub-groups and sub-groups hold several
parameters) trains 3 steps, saves both formats and trains 3 more; the same with host offload
(``cpu``) and without offload (``none``: torch's AdamW on the device). ``nvme_load``: fresh
engines (other weights, other RNG states) load the NVMe checkpoints onto NVMe, host offload
and no offload, and the others onto NVMe, and train the same 3 steps. Swap files go
under the checkpoint root, on a real file system (pytest's temporary folder is on disk here).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.checkpoint._common import Resume

STAGES = (1, 2, 3)
FORMATS = ("native", "universal")
#: target -> the checkpoint it loads: NVMe and host-offload checkpoints onto each placement.
LOADS = {
    "nvme_from_nvme": ("nvme", "nvme"),
    "cpu_from_nvme": ("cpu", "nvme"),
    "none_from_nvme": ("none", "nvme"),
    "nvme_from_cpu": ("nvme", "cpu"),
    "nvme_from_none": ("nvme", "none"),
}


def scenario(stage: int) -> Resume:
    return Resume(stage=stage, optimizer="config")


def engine_for(stage: int, device: str, root: Path, seed: int) -> Any:
    import ds_core
    from tests.checkpoint._common import build_model

    sc = scenario(stage)
    cfg = sc.config(2)
    zcfg = cfg["zero_optimization"]
    if device == "nvme":
        swap = root / "swap"
        swap.mkdir(parents=True, exist_ok=True)
        zcfg["offload_optimizer"] = {"device": "nvme", "nvme_path": str(swap), "buffer_count": 2}
        zcfg["sub_group_size"] = 37
    elif device == "cpu":
        zcfg["offload_optimizer"] = {"device": "cpu"}
    torch.manual_seed(seed)
    model = build_model(sc.model)
    engine, _, _, _ = ds_core.initialize(
        model=model,
        config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )
    return engine


def opt_state(engine: Any) -> dict[str, dict[str, Any]]:
    """Per parameter: this rank's fp32 piece, moments and step, wherever they live (read
    through the swap engine for NVMe), in one layout for every placement, as host copies (a
    process without the device reads them)."""
    from ds_core.checkpoint._nvme import swap

    nv = swap(engine)
    out: dict[str, dict[str, Any]] = {}
    for name, zp in engine.zparams.items():
        if zp.master is None:
            continue
        if nv is not None:
            values = nv.read_piece(zp)
            step = nv.step_count or None
        else:
            values = {"fp32": zp.master.detach().reshape(-1).to("cpu", copy=True)}
            state = engine.optimizer.state.get(zp.master, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in state:
                    values[k] = state[k].detach().reshape(-1).to("cpu", copy=True)
            step = state.get("step")
        if nv is not None:
            nv.settle()
        if step is not None:
            values["step"] = int(float(step))
        out[name] = values
    return out


def snapshot(engine: Any, losses: list[float]) -> dict[str, Any]:
    return {
        "state": opt_state(engine),
        "params": engine.gathered_state_dict(),
        "losses": losses,
        "counters": (engine.global_steps, engine.micro_steps),
        "lr": engine.get_lr(),
        # drawn last: equal only if every RNG was restored
        "rng": (torch.rand(4), random.random(), float(np.random.rand())),
    }


def save_job(stage: int, device: str, root: Path) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        from ds_core import comm
        from tests.checkpoint._worker import seed_all, train

        sc = scenario(stage)
        engine = engine_for(stage, device, root, seed=0)
        seed_all(100 + comm.get_rank())
        train(engine, sc, sc.n)
        at_save = opt_state(engine)
        folder = root / f"{device}_s{stage}"
        engine.save_checkpoint(str(folder / "native"))
        engine.save_checkpoint(str(folder / "universal"), universal=True)
        swap_files = (
            sorted(p.name for p in (root / "swap").rglob("*.swp")) if device == "nvme" else []
        )
        snap = snapshot(engine, train(engine, sc, sc.n))
        snap["at_save"] = at_save
        snap["swap_files"] = swap_files
        engine.destroy()
        return snap

    return run


def load_job(stage: int, label: str, fmt: str, root: Path) -> Callable[[], dict[str, Any]]:
    target, source = LOADS[label]

    def run() -> dict[str, Any]:
        from tests.checkpoint._worker import seed_all, train

        sc = scenario(stage)
        engine = engine_for(stage, target, root, seed=999)  # other weights: the load replaces them
        seed_all(7)  # other RNG states: the load restores them
        path, _ = engine.load_checkpoint(str(root / f"{source}_s{stage}" / fmt))
        loaded = opt_state(engine)
        snap = snapshot(engine, train(engine, sc, sc.n))
        snap["loaded"] = loaded
        snap["path"] = path
        engine.destroy()
        return snap

    return run


def jobs(suite: str, root: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    if suite == "nvme_save":
        return {
            f"save_{device}_s{s}": save_job(s, device, root)
            for s in STAGES
            for device in ("nvme", "cpu", "none")
        }
    if suite == "nvme_load":
        return {
            f"{label}_s{s}_{fmt}": load_job(s, label, fmt, root)
            for s in STAGES
            for label in LOADS
            for fmt in FORMATS
        }
    raise SystemExit(f"unknown suite {suite}")
