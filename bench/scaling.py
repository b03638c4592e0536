"""How ds_core's step time, memory per rank and bytes per rank grow with model and world size.

Run: ``python bench/scaling.py`` (about 5 minutes on a 2-core machine); options:
``--presets small,medium,large --worlds 1,2,4 --configs ds0,ds1,ds2,ds3 --steps 3
--plot out/bench/scaling.png``.

For each world size (separate gloo process groups, one thread per rank; more ranks than cores
is noted as oversubscribed, and its times then measure the machine's time-slicing more than
the engine) every model preset is trained for a few steps in every configuration, with the
same GPT, data and seeds as bench/zero_vs_peers.py (whose measuring code this reuses). It
prints one table and writes a PNG: the top row against model size at 2 ranks, the bottom row
against world size for the largest model. Expected shape: model-state bytes per rank fall as
1/N for what each stage partitions, and logical bytes per rank stay at 2Ψ (stages 0-2) or
3Ψ (stage 3) whatever the world size. It prints and never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_report
import zero_vs_peers as harness

from examples.gpt import GPT, PRESETS, encode, make_corpus

MiB = 2**20


def worker(rank: int, args: argparse.Namespace, port: int, world: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    import ds_core

    ds_core.init_distributed(timeout=600)
    tokens = encode(make_corpus())
    rows = []
    for preset in args.presets.split(","):
        for name in args.configs.split(","):
            run_args = argparse.Namespace(**{**vars(args), "preset": preset})
            r = harness.run_one(name, run_args, tokens)
            rows.append(
                {
                    "world": world,
                    "preset": preset,
                    "config": name,
                    "error": r.error,
                    "step_s": statistics.median(r.step_s) if r.step_s else None,
                    "state": max(r.state_bytes) if r.state_bytes else None,
                    "peak": max(r.peak_above_baseline) if r.peak_above_baseline else None,
                    "logical": r.logical_per_step,
                }
            )
            if rank == 0:
                status = r.error or f"{statistics.median(r.step_s) * 1e3:.0f} ms"
                print(f"  world {world} {preset:<6} {name}: {status}", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def table(rows: list[dict[str, Any]], cores: int) -> str:
    head = (
        f"{'ranks':>5} {'model':<7} {'params':>7} {'config':<6} {'step ms':>8} "
        f"{'state MiB/rank':>14} {'formula':>8} {'peak MiB/rank':>13} {'comm MiB/rank':>13} "
        f"{'comm/Ψ':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        n = GPT(PRESETS[r["preset"]]).n_params()
        note = "  (oversubscribed)" if r["world"] > cores else ""
        if r["error"]:
            lines.append(f"{r['world']:>5} {r['preset']:<7} {r['config']:<6} {r['error']}")
            continue
        stage = peers_report.config_stage(r["config"])
        formula = peers_report.zero_formula_bytes(n, stage, r["world"])
        lines.append(
            f"{r['world']:>5} {r['preset']:<7} {n / 1e6:>6.1f}M {r['config']:<6} "
            f"{r['step_s'] * 1e3:>8.0f} {r['state'] / MiB:>14.1f} {formula / MiB:>8.1f} "
            f"{r['peak'] / MiB:>13.0f} {r['logical'] / MiB:>13.1f} "
            f"{r['logical'] / (4 * n):>6.2f}{note}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, presets: list[str], worlds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["error"]]
    configs = sorted({r["config"] for r in ok})
    metrics = [("step_s", "step time (s)"), ("state", "model states / rank (MiB)"),
               ("logical", "comm / rank / step (MiB)")]  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    mid_world = 2 if 2 in worlds else worlds[0]
    for col, (key, label) in enumerate(metrics):
        scale = 1.0 if key == "step_s" else 1 / MiB
        for cfg in configs:
            by_size = [r for p in presets for r in ok
                       if r["config"] == cfg and r["preset"] == p and r["world"] == mid_world]  # fmt: skip
            axes[0][col].plot(
                [GPT(PRESETS[r["preset"]]).n_params() / 1e6 for r in by_size],
                [r[key] * scale for r in by_size], marker="o", label=cfg,
            )  # fmt: skip
            by_world = [r for w in worlds for r in ok
                        if r["config"] == cfg and r["preset"] == presets[-1] and r["world"] == w]  # fmt: skip
            axes[1][col].plot(
                [r["world"] for r in by_world], [r[key] * scale for r in by_world],
                marker="o", label=cfg,
            )  # fmt: skip
        axes[0][col].set(xlabel=f"parameters (M), {mid_world} ranks", ylabel=label)
        axes[1][col].set(xlabel=f"ranks, model {presets[-1]}", ylabel=label, xticks=worlds)
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="small,medium,large")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--configs", default="ds0,ds1,ds2,ds3")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--plot", default="out/bench/scaling.png")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = len(os.sched_getaffinity(0))
    worlds = [int(w) for w in args.worlds.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            print(f"world size {world}" + (" (oversubscribed)" if world > cores else ""))
            out = str(Path(tmp) / f"w{world}.json")
            args.world = world
            mp.spawn(worker, args=(args, harness.free_port(), world, out), nprocs=world)
            rows += json.loads(Path(out).read_text())
    print(
        f"\nmicro-batch {args.micro_batch} × seq {args.seq}, fp32, {args.steps} measured steps "
        f"(median), {cores} cores, torch {torch.__version__}; formula: ZeRO fp32 model states "
        f"per rank; comm/Ψ: logical bytes per step over the fp32 gradient bytes"
    )
    print(table(rows, cores))
    try:
        plot(rows, Path(args.plot), args.presets.split(","), worlds)
        print(f"plot: {args.plot}")
    except ImportError:
        print("(pip install matplotlib for the plot)")


if __name__ == "__main__":
    main()
