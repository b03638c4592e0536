"""Which implementation of each logical collective is fastest on gloo (2 ranks, this machine).

Run: ``python bench/gloo_collectives.py [--mib 32] [--reps 7]``. Each rank times, interleaved,
the native reduce-scatter against the CPU backend's all-reduce-then-slice, and the native
all-gather against an all-reduce of a zero-padded buffer, and prints medians and ratios.
The CPU backend's ``ds_comm_reduce_scatter`` override is justified by these figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _run(rank: int, port: int, mib: int, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    n = mib * 2**20 // 4
    full, shard = torch.ones(n), torch.empty(n // WORLD)
    rs_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def native_rs() -> None:
        rs_single(shard, full)

    def allreduce_rs() -> None:
        dist.all_reduce(full)
        shard.copy_(full[rank * shard.numel() : (rank + 1) * shard.numel()])

    def native_ag() -> None:
        ag_single(full, shard)

    def allreduce_ag() -> None:
        full.zero_()
        full[rank * shard.numel() : (rank + 1) * shard.numel()].copy_(shard)
        dist.all_reduce(full)

    cases = {
        "reduce-scatter native": native_rs,
        "reduce-scatter via all-reduce": allreduce_rs,
        "all-gather native": native_ag,
        "all-gather via all-reduce": allreduce_ag,
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():  # interleaved: machine noise hits every case alike
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"gloo, {WORLD} ranks, {mib} MiB fp32 full buffer, median of {reps}")
        for k, v in med.items():
            spread = max(times[k]) - min(times[k])
            print(f"  {k:<32} {v * 1e3:8.1f} ms  (spread {spread * 1e3:.1f} ms)")
        print(
            f"  reduce-scatter: native / all-reduce = "
            f"{med['reduce-scatter native'] / med['reduce-scatter via all-reduce']:.2f}"
        )
        print(
            f"  all-gather:     native / all-reduce = "
            f"{med['all-gather native'] / med['all-gather via all-reduce']:.2f}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(port, args.mib, args.reps), nprocs=WORLD)


if __name__ == "__main__":
    main()
