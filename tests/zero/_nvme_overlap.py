"""One process (world size 1): NVMe optimizer offload with write-backs left draining against
host offload, bit for bit, and checkpoints saved right after a step (see
tests/zero/test_zero_nvme.py::test_write_backs_drain_after_the_step_and_a_save_waits_for_them).

Run as ``python -m tests.zero._nvme_overlap <work folder> <port> <stage>``; prints one JSON
line. Every swap write sleeps first (a slow disk), so the write-backs of a step are still in
flight when ``step()`` returns and a save that did not wait for them would read stale files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ds_core
from ds_core.checkpoint import CheckpointReader

SLOW_WRITE_S = 0.15  # one request per sub-group (three before): the same margin


class _SlowWrites:
    """The engine's transfer, each write delayed (reads untouched)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.path = inner, inner.path

    def __call__(self, path: str, write: bool, *rest: Any) -> None:
        if write:
            time.sleep(SLOW_WRITE_S)
        self.inner(path, write, *rest)


def _train(work: Path, stage: int, nvme: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(),
                          nn.Linear(40, 8))  # fmt: skip
    off: dict[str, Any] = {"device": "cpu"}
    if nvme:
        folder = work / f"swap_s{stage}"
        folder.mkdir(exist_ok=True)
        off = {"device": "nvme", "nvme_path": str(folder), "buffer_count": 3}
    cfg = {
        "train_batch_size": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
        "log_level": "warning",
        "zero_optimization": {"stage": stage, "sub_group_size": 700, "offload_optimizer": off,
                              "stage3_param_persistence_threshold": 0},
    }  # fmt: skip
    engine, *_ = ds_core.initialize(model=model, config=cfg)
    out: dict[str, Any] = {"losses": [], "params": [], "in_flight": [], "saves": []}
    if nvme:
        io = engine.offload.io
        io.impl = _SlowWrites(io.impl)
        out["sub_groups"] = len(engine.offload.sub_groups)
        out["buffers"] = len(engine.offload._buffers)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if nvme:  # write-backs still draining when step() returned
            out["in_flight"].append(sum(not f.done() for f in io._pending))
        out["losses"].append(float(loss.detach()))
        out["params"].append([p.detach().clone() for p in model.parameters()])
        if step in (1, 4):  # right after the step; the next step runs after a save
            tag = f"s{stage}_{'nvme' if nvme else 'cpu'}_{step}"
            engine.save_checkpoint(str(work / "ckpt"), tag=tag)
            out["saves"].append(tag)
    engine.destroy()
    return out


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested tensors and containers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def main() -> None:
    work, port, stage = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    cpu, nvme = _train(work, stage, False), _train(work, stage, True)
    params = all(
        torch.equal(a, b)
        for pa, pb in zip(cpu["params"], nvme["params"], strict=True)
        for a, b in zip(pa, pb, strict=True)
    )
    mismatched: list[str] = []
    for tc, tn in zip(cpu["saves"], nvme["saves"], strict=True):
        ours, theirs = CheckpointReader(work / "ckpt" / tn), CheckpointReader(work / "ckpt" / tc)
        if list(ours.keys()) != list(theirs.keys()):
            mismatched.append(f"{tn}: keys differ")
            continue
        for key in ours.keys():
            a, b = ours.entry(key), theirs.entry(key)
            if not _same(a, b):
                mismatched.append(f"{tn}: {key}")
    report = {
        "losses_equal": cpu["losses"] == nvme["losses"],
        "params_equal": params,
        "checkpoint_mismatches": mismatched,
        "in_flight": nvme["in_flight"],
        "sub_groups": nvme["sub_groups"],
        "buffers": nvme["buffers"],
        "saves": len(nvme["saves"]),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
