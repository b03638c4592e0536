"""One rank of a hang-check trial: ``python -m tests._hangs_rank CASE WORKDIR`` (RANK etc. set
by tests/test_hangs.py). Rank :data:`CULPRIT` misbehaves as CASE says; the others train a
ZeRO stage-2 engine normally for :data:`STEPS` updates and leave.

- ``no_model``: its loss does not depend on the model (no gradient reaches a parameter);
- ``skip_step``: it skips ``step()`` once; ``double_step``: it calls ``step()`` twice;
- ``micro_batches``: it runs one micro-batch more per update than the others;
- ``some_only``: it issues an all_reduce (a metric) that the others do not;
- ``leave_early``: it leaves (``destroy_distributed``) after one update;
- ``finally_leave``: it raises after one update inside ``try/finally: destroy_distributed()``;
- ``compute`` (no fault): rank 0 computes (sleeps) for ``SLEEP_S`` before the second update's
  backward (:data:`SLEEP_STEP`: past a whole update, so every channel has calls on record)
  while the others wait in a collective: nothing may be reported;
- ``slow``: as ``compute``, for far longer than ``DS_HANG_TIMEOUT_S``: the timeout reports it.

Every rank that ends writes ``shm.rank<r>.json`` (the /dev/shm names it maps) from an abort
callback, or at a normal end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

CULPRIT = 1
STEPS = 3
#: the update before whose backward rank 0 computes in ``compute`` and ``slow``
SLEEP_STEP = 1


def _shm_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        fields = [line.split(maxsplit=5) for line in f if "/dev/shm/" in line]
    return sorted({f[5].strip().removesuffix(" (deleted)") for f in fields if len(f) == 6})


def main() -> None:
    case, work = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    import ds_core
    from ds_core.comm import liveness

    ds_core.init_distributed(timeout=900)  # far beyond the test's guard
    done = work / f"shm.rank{rank}.json"
    liveness.on_abort("tests.hangs", lambda: done.write_text(json.dumps(_shm_maps())))
    gas = 2 if case == "micro_batches" else 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = ds_core.initialize(model=model, config=config)
    acc = ds_core.get_accelerator()
    dev = acc.device()
    culprit = rank == CULPRIT
    sleep_s = float(os.environ.get("SLEEP_S", "0"))
    try:
        for step in range(STEPS):
            if case == "leave_early" and culprit and step == 1:
                break
            if case == "finally_leave" and culprit and step == 1:
                raise ValueError("the culprit's own error")
            extra = case == "micro_batches" and culprit
            for _ in range(gas + (1 if extra else 0)):
                x, y = torch.randn(4, 8).to(dev), torch.randn(4, 4).to(dev)
                if case in ("compute", "slow") and rank == 0 and step == SLEEP_STEP:
                    time.sleep(sleep_s)
                out = engine(x)
                if case == "no_model" and culprit:
                    loss = (x.requires_grad_() * 2).sum()  # not computed from the model
                else:
                    loss = torch.nn.functional.mse_loss(out, y)
                engine.backward(loss)
                if case == "skip_step" and culprit and step == 0:
                    continue
                engine.step()
                if case == "double_step" and culprit and step == 0:
                    engine.step()
            if case == "some_only" and culprit and step == 0:
                acc.all_reduce(loss.detach().reshape(1))
    finally:
        if case == "finally_leave":
            ds_core.destroy_distributed()
    engine.destroy()
    done.write_text(json.dumps(_shm_maps()))
    ds_core.destroy_distributed()


if __name__ == "__main__":
    main()
