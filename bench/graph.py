"""Replay vs eager for captured forwards through ``engine.capture`` on the selected backend.

Run: ``python bench/graph.py [--number N] [--repeat R] [--preset tiny|small] [--sdpa
default|math]``. Prints, per workload, the wall and CPU microseconds per forward (best of R
rounds of N calls; the columns are interleaved within each round) eager (``no_grad``) and
replayed, and eager / replay. Never asserts. Workloads: the GPT example's forward (loss) at
micro-batch 1 and a small MLP (many small ops, where replay has the most to save).

On the CPU backend a "graph" is a recording of aten ops compiled into one TorchScript graph
(ds_backend_cpu.graph_replay), so replay skips the Python module tree and the per-op Python
calls but runs the same kernels. There the bench adds a column replaying the same recording
with a Python loop over the ops (``CpuGraph(torchscript=False)``), the alternative the
TorchScript lowering was measured against.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_core
from examples.gpt import GPT, PRESETS


def interleaved_us(
    fns: dict[str, Callable[[], Any]], number: int, repeat: int
) -> dict[str, tuple[float, float]]:
    """Best wall and best CPU µs per call of each function, timed in turn in each round.

    CPU time (this process's) is the steadier figure on a shared machine: waiting for a core
    does not count, cache and frequency contention still do.
    """
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(number):
                fn()
            wall[name].append((time.perf_counter() - t0) / number * 1e6)
            cpu[name].append((time.process_time() - c0) / number * 1e6)
    return {name: (min(wall[name]), min(cpu[name])) for name in fns}


def python_loop_replay(engine: Any, inputs: tuple[torch.Tensor, ...]) -> Callable[[], Any]:
    """The same capture replayed by the Python op loop (CPU backend only)."""
    from ds_backend_cpu.graph import CpuGraph

    graph = CpuGraph(torchscript=False)
    static = tuple(t.clone() for t in inputs)
    with torch.no_grad(), graph.capture():
        out = engine(*static)

    def run() -> Any:
        graph.replay()
        return out

    return run


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
    ap.add_argument(
        "--sdpa",
        default="default",
        choices=["default", "math"],
        help="attention kernel in every column: torch's choice (the fused one on CPU) or math",
    )
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
    backend = ds_core.get_accelerator().name
    print(
        f"backend {backend}, 1 thread, sdpa {args.sdpa}, best of {args.repeat} rounds x "
        f"{args.number} calls, columns interleaved; each cell: wall / CPU µs per call, ratio "
        f"eager over that column (wall / CPU)"
    )
    header = f"{'workload':32} {'eager':>15} {'replay':>15} {'eager/replay':>12}"
    if backend == "cpu":
        header += f" {'py-loop':>15} {'eager/py-loop':>13}"
    print(header)
    for name, model, inputs in workloads:
        engine = engine_for(model)
        attention = sdpa_kernel(SDPBackend.MATH) if args.sdpa == "math" else nullcontext()
        with attention, torch.no_grad():
            run = engine.capture(lambda *t, e=engine: e(*t), *inputs)
            fns: dict[str, Callable[[], Any]] = {
                "eager": lambda e=engine, i=inputs: e(*i),
                "replay": run,
            }
            if backend == "cpu":
                fns["py-loop"] = python_loop_replay(engine, inputs)
            same = torch.equal(run(), engine(*inputs))
            if "py-loop" in fns:
                same = same and torch.equal(fns["py-loop"](), engine(*inputs))
            us = interleaved_us(fns, args.number, args.repeat)
        row = f"{name:32}"
        for col in fns:
            wall, cpu = us[col]
            row += f" {wall:7.1f}/{cpu:7.1f}"
            if col != "eager":
                ratio = f"{us['eager'][0] / wall:.2f}/{us['eager'][1] / cpu:.2f}"
                row += f" {ratio:>12}"
        kind = getattr(run.graph, "program", None)
        ops = f", {kind.kind} {kind.ops} ops" if kind is not None else ""
        print(f"{row}  bitwise={same}{ops}")
        engine.destroy()


if __name__ == "__main__":
    main()
