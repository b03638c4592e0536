"""DeepSpeed's unit test ``TestStage2IgnoreUnusedParameters``, transcribed.

Source: github.com/deepspeedai/DeepSpeed, tests/unit/runtime/zero/test_ignore_unused_parameters.py
at edaa7221267243c7be7fb49c5d5f5c4fb97b4641, both parametrizations (``ignore_unused_parameters``
True: trains; False: the loop must raise an ``AssertionError`` naming the key). ZeRO stage 2 with
``cpu_offload``, micro-batch 2, 2 accumulation steps, a model with a parameter no forward uses.
A ``DistributedTest`` of 1 rank there; here on 2. Departures are marked ``# CHANGED``.
"""

from __future__ import annotations

from typing import Any

import deepspeed  # resolved to ds_core by tests/compat/clients.deepspeed_shim
import torch
from deepspeed.accelerator import get_accelerator

from tests.compat.clients._unit_common import UnusedParametersModel, random_dataloader, seed_for


def test(ignore_unused_parameters: bool, rank: int) -> dict[str, Any]:
    use_cpu_offload = True
    # CHANGED: the skip when cpu-adam is not compatible (deepspeed.ops.__compatible_ops__, a
    # DeepSpeed op-builder table) is dropped; ds_core's CPU Adam is built in.
    config_dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "zero_optimization": {
            "stage": 2,
            "cpu_offload": use_cpu_offload,
            "ignore_unused_parameters": ignore_unused_parameters,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    # CHANGED: no bf16 / fp16 section (the original enables bf16, else fp16, where the
    # accelerator has it): the corpus compares at fp32.
    assert get_accelerator() is not None
    hidden_dim = 4
    torch.manual_seed(0)  # CHANGED: seeded, so every rank and the twin start alike
    model = UnusedParametersModel(hidden_dim=hidden_dim)
    model, _, _, _ = deepspeed.initialize(
        config=config_dict, model=model, model_parameters=model.parameters()
    )
    seed_for(rank)  # CHANGED: see _unit_common.seed_for
    data_loader = random_dataloader(
        model=model, total_samples=10, hidden_dim=hidden_dim, device=model.device
    )
    losses, batches = [], []  # CHANGED: recorded for the twin

    def _loop() -> None:
        for _n, batch in enumerate(data_loader):
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            losses.append(loss.item())
            batches.append(batch)

    if ignore_unused_parameters:
        _loop()
        return {"losses": losses, "batches": batches, "state": model.module_state_dict()}
    # CHANGED: pytest.raises(AssertionError) as a plain try, and the outcome returned for the
    # test to check (an error on one rank only would leave the other in a collective).
    try:
        _loop()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "micro_batches": len(losses)}
    return {"raised": None, "message": "", "micro_batches": len(losses)}


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    out = test(True, rank)
    out["refused"] = test(False, rank)
    return out


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain PyTorch: Adam at 1e-3 (DeepSpeed's CPU Adam, no weight decay), the ranks' mean loss
    divided by the 2 accumulation steps, a step every 2 micro-batches, clipping at 1.0; the
    fifth micro-batch accumulates and is never stepped, as in the loop."""
    from tests.compat.clients import _twin

    torch.manual_seed(0)
    model = UnusedParametersModel(4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses: list[list[float]] = [[] for _ in range(world)]
    for micro in range(len(results[0]["batches"])):
        step_losses = _twin.dp_backward(
            lambda b: model(b[0], b[1]) / 2, [r["batches"][micro] for r in results]
        )
        if micro % 2 == 1:
            _twin.clip(model, 1.0)
            opt.step()
            opt.zero_grad()
        for rank, value in enumerate(step_losses):
            losses[rank].append(value * 2)
    return {"losses": losses, "state": model.state_dict()}
