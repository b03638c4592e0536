"""Step time with and without the deterministic policy, on the selected backend.

Run: ``python bench/determinism.py [--steps N] [--repeat R] [--threads T]``. Prints, per
workload, milliseconds per step (best of R repeats of N steps) without and with
``ds_core.determinism.enable`` and their ratio. Never asserts. Workloads: a training step of
the GPT example (tiny preset, micro-batch 4, T 64) through a world-size-1 ZeRO stage-1 engine,
and an index backward with 2^17 colliding indices (the conformance check's workload), whose
host kernel is parallel with atomics normally and serial under the policy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_core
from ds_core import determinism
from examples.gpt import GPT, PRESETS


def best_ms(fn: Callable[[], Any], steps: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e3


def gpt_step() -> Callable[[], None]:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = ds_core.initialize(model=model, optimizer=opt, config=cfg)
    idx = torch.randint(0, 32, (4, 64))

    def step() -> None:
        engine.backward(engine(idx, idx))
        engine.step()

    return step


def index_backward() -> Callable[[], None]:
    n = 1 << 17
    table = torch.randn(8, 16, requires_grad=True)
    idx = torch.randint(0, 8, (n,))
    src = torch.randn(n, 16)

    def step() -> None:
        table.grad = None
        (table[idx] * src).sum().backward()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    acc = ds_core.get_accelerator()
    print(f"backend {acc.name}, {args.threads} thread(s), best of {args.repeat}x{args.steps}")
    print(f"{'workload':36} {'off ms':>9} {'on ms':>9} {'on/off':>7}")
    for name, make in (
        ("gpt-tiny train step (mb 4, T 64)", gpt_step),
        ("index backward, 2^17 colliding", index_backward),
    ):
        step = make()
        off = on = float("inf")
        for _ in range(args.repeat):  # interleaved, so drift in machine load hits both
            off = min(off, best_ms(step, args.steps, 1))
            with determinism.enable(0):
                on = min(on, best_ms(step, args.steps, 1))
        print(f"{name:36} {off:9.2f} {on:9.2f} {on / off:6.2f}x")


if __name__ == "__main__":
    main()
