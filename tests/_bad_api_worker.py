"""Engine API misuse on one rank, in one process: each case's outcome by name, as JSON on
stdout's last line. Read by tests/test_bad_inputs.py (one process for every case keeps the
corpus fast)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_core

CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 1,
    "log_level": "info",  # the progress lines are info records; DeepSpeed's default leaves them out
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def engine(stage: int = 0, model: nn.Module | None = None, **cfg: Any) -> Any:
    config = {**CONFIG, "zero_optimization": {"stage": stage}, **cfg}
    eng, _, _, _ = ds_core.initialize(model=model or net(), config=config)
    return eng


def loss_of(eng: Any) -> torch.Tensor:
    x, y = batch()
    return nn.functional.mse_loss(eng(x), y)


def outcome(fn: Callable[[], Any]) -> str:
    try:
        result = fn()
    except Exception as exc:  # the case records which error, the test judges it
        return f"{type(exc).__name__}: {exc}"
    return f"ok: {result}"


def train_losses(eng: Any, steps: int = 5) -> list[float]:
    out = []
    for _ in range(steps):
        loss = loss_of(eng)
        eng.backward(loss)
        eng.step()
        out.append(float(loss))
    return out


def second_initialize(stage: int) -> str:
    model = net()
    first = engine(stage, model)
    msg = outcome(lambda: engine(stage, model))
    # the first engine still trains after the refusal
    losses = train_losses(first)
    first.destroy()
    return f"{msg} | first engine losses fell: {losses[-1] < losses[0]}"


def destroyed(call: str) -> str:
    eng = engine()
    x, y = batch()
    loss = nn.functional.mse_loss(eng(x), y)
    eng.destroy()
    eng.destroy()  # a second destroy does nothing
    calls: dict[str, Callable[[], Any]] = {
        "forward": lambda: eng(x),
        "backward": lambda: eng.backward(loss),
        "step": eng.step,
        "save_checkpoint": lambda: eng.save_checkpoint(tempfile.mkdtemp()),
        "load_checkpoint": lambda: eng.load_checkpoint(tempfile.mkdtemp()),
        "state_dict": eng.state_dict,
        "initialize_again": lambda: engine(0, eng.module),
    }
    return outcome(calls[call])


def frozen() -> str:
    model = net()
    for p in model.parameters():
        p.requires_grad_(False)
    return outcome(lambda: engine(0, model))


def frozen_forward_only() -> str:
    model = net()
    for p in model.parameters():
        p.requires_grad_(False)

    def run() -> Any:
        config = {"train_micro_batch_size_per_gpu": 4}
        eng, _, _, _ = ds_core.initialize(model=model, config=config)
        out = eng(batch()[0])
        eng.destroy()
        return tuple(out.shape)

    return outcome(run)


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def with_engine(fn: Callable[[Any], Any], stage: int = 0) -> str:
    eng = engine(stage)
    try:
        return outcome(lambda: fn(eng))
    finally:
        eng.destroy()


def nan_loss_fp32() -> dict[str, Any]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ds_core").addHandler(Keep())
    eng = engine(2, gradient_clipping=1.0)
    train_losses(eng, 2)
    loss = loss_of(eng) * math.nan
    eng.backward(loss)
    eng.step()
    train_losses(eng, 1)
    finite = all(bool(torch.isfinite(p).all()) for p in eng.module.parameters())
    skipped = eng.skipped_steps
    eng.destroy()
    return {"skipped": skipped, "finite": finite, "log": records}


def main() -> None:
    ds_core.init_distributed()
    results: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        results[f"second_initialize_s{stage}"] = second_initialize(stage)
    results["model_none"] = outcome(lambda: ds_core.initialize(model=None, config=CONFIG))
    results["model_callable"] = outcome(
        lambda: ds_core.initialize(model=lambda x: x, config=CONFIG)  # type: ignore[arg-type]
    )
    results["model_string"] = outcome(lambda: ds_core.initialize(model="gpt", config=CONFIG))  # type: ignore[arg-type]
    results["model_frozen"] = frozen()
    results["model_no_params"] = outcome(lambda: engine(0, NoParams()))
    results["model_frozen_forward_only"] = frozen_forward_only()
    for call in (
        "forward",
        "backward",
        "step",
        "save_checkpoint",
        "load_checkpoint",
        "state_dict",
        "initialize_again",
    ):
        results[f"destroyed_{call}"] = destroyed(call)
    results["loss_vector"] = with_engine(
        lambda e: e.backward(e(batch()[0]) - batch()[1])  # shape (4, 1)
    )
    results["loss_float"] = with_engine(lambda e: e.backward(float(loss_of(e))))
    results["loss_detached"] = with_engine(lambda e: e.backward(loss_of(e).detach()))
    results["loss_no_grad"] = with_engine(lambda e: _no_grad_backward(e))
    results["loss_other_model"] = with_engine(lambda e: _other_model_backward(e))
    for stage in (0, 2):
        results[f"step_without_backward_s{stage}"] = with_engine(lambda e: e.step(), stage)
        results[f"step_twice_s{stage}"] = with_engine(lambda e: _step_twice(e), stage)
    results["one_element_loss_shape_1"] = with_engine(
        lambda e: e.backward(loss_of(e).reshape(1)) or "backward ran"
    )
    results["nan_loss_fp32"] = nan_loss_fp32()
    print(json.dumps(results))
    sys.stdout.flush()
    ds_core.destroy_distributed()
    os._exit(0)


def _no_grad_backward(e: Any) -> None:
    with torch.no_grad():
        loss = loss_of(e)
    e.backward(loss)


def _other_model_backward(e: Any) -> None:
    other = nn.Linear(8, 1)
    x, y = batch()
    e.backward(nn.functional.mse_loss(other(x), y))


def _step_twice(e: Any) -> None:
    e.backward(loss_of(e))
    e.step()
    e.step()


if __name__ == "__main__":
    main()
