"""Rank worker: ``python -m tests.interop._lightning_worker KIND OUTDIR``.

Started once, as rank 0: the first ``Fabric(devices=2, strategy="ddp").launch()`` has
Lightning's own launcher start rank 1 (it re-runs this command with ``LOCAL_RANK=1``) and sets
``LOCAL_RANK`` here, so every later Fabric or Trainer in both processes finds its processes
already created. Each rank writes ``OUTDIR/rank<r>.json``.

KIND ``cpu``: Fabric and Trainer on ``accelerator="cpu"`` and on ``accelerator="ds_core"``
(``DS_ACCELERATOR=cpu``), in one pair of processes. KIND ``sim`` (``DS_ACCELERATOR=sim``):
Fabric and Trainer DDP on ``ds_core`` with ``strategy="ds_core_ddp"`` (one sim device per
rank), then each rank trains the whole batch on its own sim device with
``SingleDeviceStrategy``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

import ds_core.interop.lightning  # noqa: F401 - registers accelerator="ds_core"
from tests.rankpool import free_port

WORLD = 2
STEPS = 3
MICRO = 2
HIDDEN = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(42)  # every rank and every run builds the same model
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(WORLD * MICRO, HIDDEN, generator=g),
            torch.randn(WORLD * MICRO, HIDDEN, generator=g),
        )
        for _ in range(STEPS)
    ]


def _pg_backend() -> str | None:
    if not torch.distributed.is_initialized():
        return None
    return str(torch.distributed.get_backend())


def _done() -> None:
    """End a run's process group so that the next run starts clean.

    Two races are closed (a CI run hung here once, rank 1 never reaching the next run): rank 0
    destroys its group only once rank 1 has left the barrier (gloo's sends may still be in
    flight when a barrier returns), and each run gets its own port, chosen by rank 0, so that
    a rank starting the next run cannot reach the previous run's store (rank 0's, until it
    destroys its group) and read that run's keys.
    """
    if not torch.distributed.is_initialized():
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        store.set("next_port", str(free_port()))
        store.wait([f"left_barrier/{r}" for r in range(1, WORLD)])
        port = store.get("next_port").decode()
    else:
        port = store.get("next_port").decode()
        store.set(f"left_barrier/{torch.distributed.get_rank()}", "1")
    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = port


def fabric_run(accelerator: str, strategy: Any = "ddp", devices: int = WORLD) -> dict[str, Any]:
    """A few SGD steps with Fabric; each rank takes its MICRO rows of every global batch
    (or the whole batch with one device)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=accelerator, devices=devices, strategy=strategy)
    fabric.launch()
    # On the device before the optimizer: Fabric re-points an optimizer at moved parameters
    # only under XLA, and torch replaces (rather than refills) host Parameters moved to a
    # PrivateUse1 device such as sim (docs/interop.md).
    model = make_model().to(fabric.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    rows = slice(fabric.global_rank * MICRO, (fabric.global_rank + 1) * MICRO)
    if devices == 1:
        rows = slice(None)
    losses = []
    for x, y in batches():
        x, y = fabric.to_device((x[rows], y[rows]))
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(float(loss.item()))
    result = {
        "accelerator": type(fabric.accelerator).__name__,
        "device": str(fabric.device),
        "process_group": _pg_backend(),
        "losses": losses,
    }
    if devices == WORLD:
        _done()
    return result


def trainer_run(accelerator: str, strategy: str = "ddp") -> dict[str, Any]:
    """``Trainer(devices=2, max_steps=STEPS)`` on a LightningModule with the same model."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.losses: list[float] = []
            self.pg: str | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.pg = _pg_backend()
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.item()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = batches()
    dataset = torch.utils.data.TensorDataset(
        torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=MICRO, shuffle=False)
    module = Module()
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=WORLD,
        strategy=strategy,
        max_steps=STEPS,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)
    result = {
        "accelerator": type(trainer.accelerator).__name__,
        "device": str(trainer.strategy.root_device),
        "process_group": module.pg,
        "losses": module.losses,
    }
    _done()
    return result


def sim_runs() -> dict[str, Any]:
    from lightning.fabric.strategies import SingleDeviceStrategy

    # the first Fabric launches rank 1 (Lightning's own launcher)
    fabric = fabric_run("ds_core", strategy="ds_core_ddp")
    trainer = trainer_run("ds_core", strategy="ds_core_ddp")
    device = f"sim:{os.environ['LOCAL_RANK']}"
    single = fabric_run("ds_core", strategy=SingleDeviceStrategy(device=device), devices=1)
    return {"fabric": fabric, "trainer": trainer, "single": single}


def main() -> None:
    kind, outdir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if kind == "cpu":
        # the first Fabric launches rank 1 (Lightning's own launcher)
        result: dict[str, Any] = {
            "fabric_cpu": fabric_run("cpu"),
            "fabric_ds_core": fabric_run("ds_core"),
            "trainer_cpu": trainer_run("cpu"),
            "trainer_ds_core": trainer_run("ds_core"),
        }
    else:
        result = sim_runs()
    rank = int(os.environ["LOCAL_RANK"])
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
