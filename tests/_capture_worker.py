"""Rank job of tests/test_determinism_graph.py's backend cases: ``engine.capture()`` on the
selected backend (a one-rank pool, tests/rankpool.py), decided by its capabilities, never its
name. Results come back on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tests.zero._common import on_device, to_host


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x))).softmax(-1)


def capture_job() -> dict[str, Any]:
    """Where the backend declares ``graph_capture``: three replays against eager forwards on
    new inputs and one after a training step. Where it does not: what ``engine.capture``
    raises, whether the function ran before the refusal, and the ``eager_fallback`` callable."""
    import ds_core

    acc = ds_core.get_accelerator()
    declared = acc.has("graph_capture")
    torch.manual_seed(0)
    model = Net()
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    if declared:
        cfg["accelerator"] = {acc.name: {"graph_capture": True}}
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    calls = [0]

    def fn(t: torch.Tensor) -> Any:
        calls[0] += 1
        return engine(t)

    g = torch.Generator().manual_seed(1)
    x = on_device(torch.randn(4, 8, generator=g))
    out: dict[str, Any] = {"declared": declared, "backend": acc.name}
    try:
        if declared:
            run = engine.capture(fn, x)
            pairs = []
            for _ in range(3):
                new = on_device(torch.randn(4, 8, generator=g))
                with torch.no_grad():
                    eager = engine(new.clone())
                pairs.append((run(new).clone(), eager))
            engine.backward(engine(on_device(torch.randn(4, 8, generator=g))).pow(2).sum())
            engine.step()
            with torch.no_grad():
                eager = engine(x.clone())
            pairs.append((run().clone(), eager))
            out["pairs"] = pairs
            return to_host(out)
        try:
            engine.capture(fn, x)
            out["refusal"] = None
        except Exception as exc:  # the test asserts the type and message
            out["refusal"] = (type(exc).__name__, str(exc), getattr(exc, "capability", None))
        out["calls_before_refusal"] = calls[0]
        run = engine.capture(fn, x, eager_fallback=True)
        out["fallback"] = {
            "captured": run.captured,
            "refusal": type(run.refusal).__name__,
            "output": run(x),
            "device": str(run(x).device),
        }
        with torch.no_grad():
            out["eager"] = engine(x)
        out["device"] = str(acc.device())
        return to_host(out)
    finally:
        engine.destroy()
