"""Replay vs eager for captured forwards through ``engine.capture`` on the selected backend.

Run: ``python bench/graph.py [--number N] [--repeat R] [--preset tiny|small]``. Prints, per
workload, the microseconds per forward (best of R repeats of N calls) eager (``no_grad``) and
replayed, and eager / replay. Never asserts. Workloads: the GPT example's forward (loss) at
micro-batch 1 and a small MLP (many small ops, where replay has the most to save).

On the CPU backend a "graph" is a recording of aten ops replayed below autograd and the
Python module tree (ds_backend_cpu.graph), so replay saves Python and dispatcher overhead but
runs the same kernels, and pays a copy for every op that returns a fresh tensor.
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
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_core
from examples.gpt import GPT, PRESETS


def best_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def engine_for(model: nn.Module) -> Any:
    name = ds_core.get_accelerator().name
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "accelerator": {name: {"graph_capture": True}},
    }
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = ds_core.get_accelerator().device()

    cfg = PRESETS[args.preset]
    seq = 64
    mlp = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())))
    workloads: list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]] = [
        (
            f"gpt-{args.preset} fwd, mb 1, T {seq}",
            GPT(cfg),
            (
                torch.randint(0, cfg.vocab_size, (1, seq), device=dev),
                torch.randint(0, cfg.vocab_size, (1, seq), device=dev),
            ),
        ),
        ("mlp 4x(32x32+gelu), batch 8", mlp, (torch.randn(8, 32, device=dev),)),
    ]
    print(
        f"backend {ds_core.get_accelerator().name}, 1 thread, best of {args.repeat}x{args.number}"
    )
    print(f"{'workload':34} {'eager us':>10} {'replay us':>10} {'eager/replay':>13}")
    for name, model, inputs in workloads:
        engine = engine_for(model)
        # The fused CPU attention kernel carries torch's "draws random numbers" tag (it has a
        # dropout argument) even at dropout 0, so the CPU graph refuses it: both columns use
        # the math kernel, which takes no random path at dropout 0.
        with sdpa_kernel(SDPBackend.MATH):
            run = engine.capture(lambda *t, e=engine: e(*t), *inputs)
            with torch.no_grad():
                eager = best_us(lambda e=engine, i=inputs: e(*i), args.number, args.repeat)
                same = torch.equal(run(), engine(*inputs))
            replay = best_us(run, args.number, args.repeat)
        print(f"{name:34} {eager:10.1f} {replay:10.1f} {eager / replay:12.2f}x  bitwise={same}")
        engine.destroy()


if __name__ == "__main__":
    main()
