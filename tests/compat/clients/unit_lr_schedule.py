"""DeepSpeed's unit test ``TestLrSchedule.test_lr_warmup_decay_schedule``, transcribed.

Source: github.com/deepspeedai/DeepSpeed, tests/unit/runtime/test_lr_schedulers.py at
edaa7221267243c7be7fb49c5d5f5c4fb97b4641, with ``warmup_num_steps=10, warmup_type="log"`` (one
of its parametrizations). A ``DistributedTest`` of 1 rank there; here on 2 (``train_batch_size``
2 is then a micro-batch of 1 per rank). Departures are marked ``# CHANGED``.
"""

from __future__ import annotations

import math
from typing import Any

import deepspeed  # resolved to ds_core by tests/compat/clients.deepspeed_shim
import torch
from deepspeed.runtime.lr_schedules import (
    TOTAL_NUM_STEPS,
    WARMUP_DECAY_LR,
    WARMUP_LOG_RATE,
    WARMUP_MAX_LR,
    WARMUP_MIN_LR,
    WARMUP_NUM_STEPS,
    WARMUP_TYPE,
)

from tests.compat.clients._unit_common import SimpleModel, random_dataloader, seed_for


def test_lr_warmup_decay_schedule(
    warmup_num_steps: int, warmup_type: str, world: int, rank: int
) -> dict[str, Any]:
    config_dict = {
        "train_batch_size": 2,
        "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "scheduler": {
            "type": WARMUP_DECAY_LR,
            "params": {
                WARMUP_MIN_LR: 0.1,
                WARMUP_MAX_LR: 0.2,
                WARMUP_NUM_STEPS: warmup_num_steps,
                TOTAL_NUM_STEPS: warmup_num_steps * 2,
                WARMUP_TYPE: warmup_type,
            },
        },
        "gradient_clipping": 1.0,
    }
    schedule_params = config_dict["scheduler"]["params"]  # type: ignore[index]
    total_num_steps = schedule_params[TOTAL_NUM_STEPS]
    hidden_dim = 10

    torch.manual_seed(0)  # CHANGED: seeded, so every rank and the twin start alike
    model = SimpleModel(hidden_dim, empty_grad=False)
    model, _, _, lr_scheduler = deepspeed.initialize(
        config=config_dict, model=model, model_parameters=model.parameters()
    )
    seed_for(rank)  # CHANGED: see _unit_common.seed_for
    # CHANGED: the 1-rank test's total_num_steps * 2 samples split over the ranks, so the loop
    # takes total_num_steps steps as there (twice as many would hold the lr at the minimum
    # after total_num_steps and fail the decay check below, with DeepSpeed too).
    data_loader = random_dataloader(
        model=model,
        total_samples=total_num_steps * 2 // world,
        hidden_dim=hidden_dim,
        device=model.device,
        dtype=torch.float,
    )
    step_lrs = []
    losses, batches = [], []  # CHANGED: recorded for the twin
    for _n, batch in enumerate(data_loader):
        loss = model(batch[0], batch[1])
        model.backward(loss)
        model.step()
        step_lrs.append(lr_scheduler.get_lr())
        losses.append(loss.item())
        batches.append(batch)

    # Verify initial lr
    assert step_lrs[0] == [schedule_params[WARMUP_MIN_LR]]
    # Verify lr at warmup completion
    warmup_num_steps = schedule_params[WARMUP_NUM_STEPS]
    warmup_max_lr = [schedule_params[WARMUP_MAX_LR]]
    assert step_lrs[warmup_num_steps] == warmup_max_lr
    # Verify decay phase
    previous_lr = warmup_max_lr
    for lr in step_lrs[warmup_num_steps + 1 :]:
        assert lr < previous_lr
        previous_lr = lr
    return {
        "losses": losses,
        "batches": batches,
        "lrs": step_lrs,
        "state": model.module_state_dict(),
    }


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    return test_lr_warmup_decay_schedule(10, WARMUP_LOG_RATE, world, rank)


def warmup_decay_lr(
    it: int, lo: float = 0.1, hi: float = 0.2, warmup: int = 10, total: int = 20
) -> float:
    """DeepSpeed's ``WarmupDecayLR`` at iteration ``it`` (−1 before the first step), log warm-up."""
    if it < 0:
        return lo
    gamma = (
        math.log(it + 1) / math.log(warmup)
        if it < warmup
        else max(0.0, (total - it) / max(1.0, total - warmup))
    )
    return lo + (hi - lo) * gamma


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain PyTorch: Adam whose lr follows DeepSpeed's WarmupDecayLR, clipping at 1.0."""
    from tests.compat.clients import _twin

    torch.manual_seed(0)
    model = SimpleModel(10)
    opt = torch.optim.Adam(model.parameters(), lr=warmup_decay_lr(-1))
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(len(results[0]["batches"])):
        step_losses = _twin.dp_backward(
            lambda b: model(b[0], b[1]), [r["batches"][step] for r in results]
        )
        _twin.clip(model, 1.0)
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:
            group["lr"] = warmup_decay_lr(step)
        for rank, value in enumerate(step_losses):
            losses[rank].append(value)
    return {"losses": losses, "state": model.state_dict()}
