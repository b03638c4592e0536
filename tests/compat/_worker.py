"""Rank worker: ``python -m tests.compat._worker WORLD OUTDIR``: every DeepSpeed-style loop
of tests/compat/_loops.py at stages 0-3 on WORLD gloo ranks, results saved per rank."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.compat import _api, _loops


def _rank(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    import ds_core as deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=300)
    out: dict[str, Any] = {"nosync_s0": _loops.nosync_loop(world, rank), "errors": _api.errors()}
    for stage in range(4):
        out[f"members_s{stage}"] = _api.members(stage)
        out[f"autocast_s{stage}"] = _loops.autocast_loop(stage, world, rank)
        out[f"simple_s{stage}"] = _loops.simple_loop(stage, world, rank)
        out[f"simple_load_s{stage}"] = _loops.simple_loop(stage, world, rank, load=True)
        out[f"cifar_s{stage}"] = _loops.cifar_loop(stage, world, rank, outdir)
        out[f"gan_s{stage}"] = _loops.gan_loop(stage, world, rank)
    torch.save(out, os.path.join(outdir, f"loops.rank{rank}.pt"))
    torch.distributed.barrier()
    deepspeed.destroy_distributed()


def main() -> None:
    world, outdir = int(sys.argv[1]), sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_rank, args=(world, port, outdir), nprocs=world, join=True)


if __name__ == "__main__":
    main()
