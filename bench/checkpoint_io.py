"""Checkpoint save/load time and the memory a save adds, for the example GPT on 2 CPU ranks.

    python bench/checkpoint_io.py                      # small (3.2 M), stages 2 and 3
    python bench/checkpoint_io.py --model large --stages 3

Per stage: train 2 steps, then save native, save universal, load each into a fresh engine.
Printed per rank: wall time of each operation, bytes written, and the resident set size the
save added over what was resident before it (sampled every millisecond by a thread: VmRSS
minus the level just before the save, and VmHWM reset through ``/proc/self/clear_refs``
where permitted, so no peak between samples is missed), next to this rank's model-state bytes and the whole
fp32 model's size, so "bounded memory" reads as a ratio. Figures, never asserted.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2**20


def status(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return status("VmRSS")


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``), where permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(fn: Callable[[], Any], repeat: int) -> tuple[float, int]:
    """Median wall seconds of ``repeat`` calls of ``fn``, and the largest resident set size a
    call added over the level just before it."""
    times, added = [], 0
    for _ in range(repeat):
        hwm = reset_hwm()
        base = rss()
        peak = [base]
        done = threading.Event()

        def sample(peak: list[int] = peak, done: threading.Event = done) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.001)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        done.set()
        t.join()
        top = max(peak[0], rss(), status("VmHWM") if hwm else 0)
        added = max(added, top - base)
    return sorted(times)[len(times) // 2], added


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, tmp: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536",
    )  # fmt: skip
    torch.set_num_threads(1)
    import ds_core
    from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus

    ds_core.init_distributed(timeout=600)
    tokens = encode(make_corpus(seed=0))
    rows: list[dict[str, Any]] = []
    tags = itertools.count()  # the same sequence on every rank: tags must agree
    for stage in args.stages:
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
        }

        def build(cfg: dict[str, Any] = cfg) -> Any:
            torch.manual_seed(0)
            model = GPT(PRESETS[args.model])
            engine, _, _, _ = ds_core.initialize(model=model, config=cfg)
            return engine

        engine = build()
        data = Batches(tokens, 4, 64, seed=0, rank=rank)
        for _ in range(2):
            x, y = data.next()
            engine.backward(engine(x, y))
            engine.step()
        states = engine.model_state_bytes()["total"]
        full = sum(zp.numel for zp in engine.zparams.values()) * 4
        row: dict[str, Any] = {"stage": stage, "rank": rank, "states": states, "full": full}
        for fmt in ("native", "universal"):
            where = Path(tmp) / f"s{stage}_{fmt}"
            torch.distributed.barrier()
            row[f"save_{fmt}"] = measure(
                lambda e=engine, w=where, f=fmt: e.save_checkpoint(
                    str(w), tag=f"t{next(tags)}", universal=f == "universal"
                ),
                args.repeat,
            )
            row[f"bytes_{fmt}"] = folder_bytes(where) // args.repeat
        engine.destroy()
        for fmt in ("native", "universal"):
            fresh = build()
            torch.distributed.barrier()
            row[f"load_{fmt}"] = measure(
                lambda e=fresh, w=Path(tmp) / f"s{stage}_{fmt}": e.load_checkpoint(str(w)),
                args.repeat,
            )
            fresh.destroy()
        rows.append(row)
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, rows)
    if rank == 0:
        report(args, [r for rank_rows in everyone for r in rank_rows])
    torch.distributed.barrier()
    ds_core.destroy_distributed()


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(
        f"GPT {args.model} on {args.world} CPU ranks (gloo), AdamW fp32, after 2 steps; "
        f"median of {args.repeat} calls"
    )
    head = (
        f"{'stage':>5} {'rank':>4} {'format':>9} {'save s':>7} {'load s':>7} {'MiB on disk':>11} "
        f"{'save +RSS MiB':>13} {'+RSS/states':>11} {'+RSS/model fp32':>15} {'load +RSS MiB':>13}"
    )
    print(head)
    for r in sorted(rows, key=lambda r: (r["stage"], r["rank"])):
        for fmt in ("native", "universal"):
            save_s, save_rss = r[f"save_{fmt}"]
            load_s, load_rss = r[f"load_{fmt}"]
            print(
                f"{r['stage']:>5} {r['rank']:>4} {fmt:>9} {save_s:>7.3f} {load_s:>7.3f} "
                f"{r[f'bytes_{fmt}'] / MiB:>11.1f} {save_rss / MiB:>13.1f} "
                f"{save_rss / r['states']:>11.2f} {save_rss / r['full']:>15.2f} "
                f"{load_rss / MiB:>13.1f}"
            )
    print(
        "states = this rank's model-state bytes (engine.model_state_bytes()); model fp32 = "
        "4 bytes x all parameters. MiB on disk: the whole checkpoint (all ranks)."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="examples.gpt preset (small)")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="calls per figure (median time)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ds_ckpt_bench_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    try:
        mp.spawn(_rank, args=(args.world, port, args, tmp), nprocs=args.world, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
