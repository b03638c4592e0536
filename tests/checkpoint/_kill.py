"""Kill worker: ``python -m tests.checkpoint._kill ROOT TAG FORMAT KILL_RANK KILL_EVENT OUT``.

Two gloo ranks train one step and save ``TAG`` into ROOT (``FORMAT`` native or universal).
Every file operation of the save (each write into a file, fsync, rename, replace) is an
*event*; rank KILL_RANK sends itself SIGKILL just before its KILL_EVENT-th one (-1: never),
so the save dies mid-write, between files, between the renames, or after ``latest`` moved.
The surviving rank is then stopped by ``mp.spawn`` (SIGTERM) wherever it is. Without a kill
each rank writes its event count to ``OUT.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.checkpoint._common import RESUME
from tests.checkpoint._worker import build, seed_all, train
from tests.rankpool import free_port, rank_env


def _arm(rank: int, kill_rank: int, kill_event: int) -> list[int]:
    from ds_core.checkpoint import _io

    count = [0]

    def event() -> None:
        if rank == kill_rank and count[0] == kill_event:
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    def wrap(fn: Any) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            event()
            return fn(*args, **kwargs)

        return inner

    writer_write = _io._HashingWriter.write
    _io._HashingWriter.write = wrap(writer_write)  # type: ignore[method-assign]
    for name in ("fsync", "rename", "replace"):
        setattr(os, name, wrap(getattr(os, name)))
    shutil.rmtree = wrap(shutil.rmtree)
    return count


def _rank(
    rank: int, port: int, root: str, tag: str, fmt: str, kill: tuple[int, int], out: str
) -> None:
    os.environ.update(rank_env(rank, 2, port, DS_ACCELERATOR="cpu"))
    torch.set_num_threads(1)
    import ds_core

    ds_core.init_distributed(timeout=60)
    sc = RESUME["s3"]
    engine = build(sc, 2, seed=0)
    seed_all(100 + rank)
    train(engine, sc, 1 if tag == "A" else 2)
    if fmt == "load":  # a fresh process group loads whatever `latest` names
        path, _ = engine.load_checkpoint(root)
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"loaded": path, "steps": engine.global_steps}, f)
        torch.distributed.barrier()
        ds_core.destroy_distributed()
        return
    count = _arm(rank, *kill)
    engine.save_checkpoint(root, tag=tag, universal=fmt == "universal")
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"events": count[0]}, f)
    torch.distributed.barrier()
    ds_core.destroy_distributed()


def _pair(root: str, tag: str, fmt: str, kill: tuple[int, int], out: str) -> str:
    """Run the two ranks (forked from this driver: no re-import); how they ended."""
    port = free_port()
    try:
        mp.start_processes(
            _rank, args=(port, root, tag, fmt, kill, out), nprocs=2, join=True, start_method="fork"
        )
    except mp.ProcessExitedException as exc:
        if exc.signal_name != "SIGKILL":
            raise
        return "killed"
    return "completed"


def _events(out: str) -> list[int]:
    return [json.loads(open(f"{out}.rank{r}.json").read())["events"] for r in range(2)]


def main() -> None:
    """``python -m tests.checkpoint._kill WORKDIR TRIALS SEED``: writes ``WORKDIR/trials.json``.

    ``WORKDIR/base`` gets checkpoint ``A`` (and ``latest``); trial ``i`` copies it to
    ``WORKDIR/trial<i>`` and saves ``B`` there, killed at a random rank and event.
    """
    work, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    base = os.path.join(work, "base")
    assert _pair(base, "A", "native", (-1, -1), os.path.join(work, "countA")) == "completed"
    counts = {"native": _events(os.path.join(work, "countA"))}
    probe = os.path.join(work, "probe")
    assert _pair(probe, "B", "universal", (-1, -1), os.path.join(work, "countU")) == "completed"
    counts["universal"] = _events(os.path.join(work, "countU"))
    shutil.rmtree(probe)
    records = []
    for i in range(trials):
        fmt = "universal" if i % 2 else "native"
        kill_rank = rng.randrange(2)
        n = counts[fmt][kill_rank]
        # every third trial aims at the publication (manifest, renames, latest): its last events
        event = rng.randrange(max(0, n - 12), n + 1) if i % 3 == 2 else rng.randrange(n + 1)
        trial = os.path.join(work, f"trial{i}")
        shutil.copytree(base, trial)
        ended = _pair(trial, "B", fmt, (kill_rank, event), os.path.join(work, f"t{i}"))
        records.append(
            {"trial": i, "format": fmt, "rank": kill_rank, "event": event, "of": n, "ended": ended}
        )
    # the first killed trial's surviving checkpoint, loaded by an engine in a fresh group
    killed = next(r["trial"] for r in records if r["ended"] == "killed")
    trial = os.path.join(work, f"trial{killed}")
    assert _pair(trial, "-", "load", (-1, -1), os.path.join(work, "load")) == "completed"
    loaded = [json.loads(open(os.path.join(work, f"load.rank{r}.json")).read()) for r in range(2)]
    with open(os.path.join(work, "trials.json"), "w") as f:
        json.dump({"seed": seed, "counts": counts, "trials": records, "load": [killed, loaded]}, f)


if __name__ == "__main__":
    main()
