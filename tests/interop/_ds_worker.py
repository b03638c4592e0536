"""Rank worker: ``python -m tests.interop._ds_worker MODE OUTDIR STAGES``.

Spawns two ranks that run ``deepspeed.initialize`` at each ZeRO stage of STAGES (``0123``) in
one process group, on DeepSpeed's unit-test SimpleModel (losses under key ``"<stage>"``) and on
the example GPT (``"gpt<stage>"``), and save them to ``OUTDIR/<MODE>.rank<r>.json``. MODE: ``adapter`` (the
ds_core adapter on the backend ``DS_ACCELERATOR`` names) or ``deepspeed`` (DeepSpeed's own
accelerator; ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

from tests.rankpool import free_port, rank_env

WORLD = 2
STEPS = 3
MICRO = 2
HIDDEN = 16


class SimpleModel(torch.nn.Module):
    """DeepSpeed's unit-test SimpleModel shape: two Linear layers and a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def batches(kind: str = "simple") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's batch for both ranks (rank r takes rows ``r·MICRO`` to ``(r+1)·MICRO``)."""
    g = torch.Generator().manual_seed(7)
    if kind == "gpt":  # token ids of examples/gpt.py's vocabulary, 16 positions
        return [
            (
                torch.randint(0, 32, (WORLD * MICRO, 16), generator=g),
                torch.randint(0, 32, (WORLD * MICRO, 16), generator=g),
            )
            for _ in range(STEPS)
        ]
    return [
        (
            torch.randn(WORLD * MICRO, HIDDEN, generator=g),
            torch.randn(WORLD * MICRO, HIDDEN, generator=g),
        )
        for _ in range(STEPS)
    ]


def build(kind: str) -> torch.nn.Module:
    """The model of ``kind`` ("simple" or "gpt": examples/gpt.py's tiny preset), seeded."""
    torch.manual_seed(42)  # every rank builds the same model
    if kind == "gpt":
        from examples.gpt import GPT, PRESETS

        return GPT(PRESETS["tiny"])
    return SimpleModel()


def run_stage(deepspeed: object, stage: int, rank: int, kind: str = "simple") -> list[float]:
    # On the device before initialize: DeepSpeed keys parameter names by Parameter object
    # before it moves the module, and torch replaces (rather than refills) host Parameters
    # moved to a PrivateUse1 device such as sim.
    model = build(kind).to(deepspeed.get_accelerator().current_device_name())  # type: ignore[attr-defined]
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)  # type: ignore[attr-defined]
    losses = []
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for x, y in batches(kind):
        loss = engine(x[sl].to(engine.device), y[sl].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    engine.destroy()
    return losses


def _rank(rank: int, port: int, mode: str, outdir: str, stages: str) -> None:
    os.environ.update(rank_env(rank, WORLD, port, LOCAL_SIZE=str(WORLD)))
    torch.set_num_threads(1)
    if mode == "adapter":
        import ds_core.interop.deepspeed

        ds_core.interop.deepspeed.install()
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's shared-memory inference all-reduce is a compiled op (about 100 s to build on
    # a cold cache) that training never calls: mark it unbuildable so neither run builds it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=None)
    accelerator = deepspeed.get_accelerator()
    accelerator.set_device(rank)  # as DeepSpeed's training scripts do with LOCAL_RANK
    result = {
        "accelerator": type(accelerator).__name__,
        "device": accelerator.current_device_name(),
        "losses": {
            f"{prefix}{stage}": run_stage(deepspeed, stage, rank, kind)
            for kind, prefix in (("simple", ""), ("gpt", "gpt"))
            for stage in map(int, stages)
        },
    }
    with open(os.path.join(outdir, f"{mode}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    mode, outdir, stages = sys.argv[1], sys.argv[2], sys.argv[3]
    port = free_port()
    mp.spawn(_rank, args=(port, mode, outdir, stages), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
