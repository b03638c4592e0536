"""CPU collectives: gloo against shared memory, with the machine's copy bound, 2 and 4 ranks.

Run: ``python bench/cpu_collectives.py [--worlds 2,4] [--min-kib 64] [--max-mib 256]
[--evict-mib 64]``. For each world size and buffer size (powers of 4 from 64 KiB to 256 MiB,
plus 32 MiB) every rank times, interleaved rep by rep: a plain ``copy_`` of the buffer (all ranks
at once, so the copy sees the same memory contention as the collectives), then all-reduce,
reduce-scatter, all-gather and broadcast over the CPU backend's gloo path (what it used before
shared memory: reduce-scatter and all-gather as all-reduces, see ``ds_backend_cpu.comm``) and
over its shared-memory path. A rep's time is the slowest rank's; the tables print medians.

Out of cache: before every timed rep of every case (the copy and each collective alike) each
rank writes a ``--evict-mib`` scratch buffer (default 64 MiB: 16x this VM's 4 MiB L2 per core;
the L3 is shared by the whole host and only partly evicted), so the copy bound is a copy
from and to memory that is not in the rank's caches, and the collectives start equally cold.

Bound: the bytes a collective must move per rank (logical bytes, docs/architecture.md §3.4:
all-reduce 2 x buffer, reduce-scatter 1 x its full input, all-gather 1 x its full output,
broadcast 1 x buffer) divided by the copy bandwidth measured at that size in this run. ``size``
is the full buffer: the all-reduce and broadcast buffer, the reduce-scatter input and the
all-gather output. ``shm/bound`` is wall time over the bound; ``cpu/bound`` the same with CPU
seconds (each rank's ``thread_time``, slowest rank): on a shared machine a rank that waits for
a descheduled peer sleeps, so CPU time is the work measure that load does not inflate.
Targets (issue 32 §2): every shared-memory collective within 1.5x its bound at >= 4 MiB on 2
ranks; all-reduce >= 3x gloo's at 32 MiB; reduce-scatter <= 0.6x the shared-memory all-reduce.

``--p2p`` instead times point-to-point between 2 ranks (issue 31): a ping-pong of synchronous
send/recv pairs over the core's gloo path and over the backend's shared-memory channels
(``ds_backend_cpu.shm_p2p``), interleaved rep by rep; one-way time is half a round trip
(latency at 4 KiB, bandwidth = bytes / one-way time at 4 and 32 MiB). Printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
LOGICAL = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0}


def _reps(nbytes: int) -> int:
    return max(3, min(30, (64 << 20) // nbytes))


def _cases(
    acc: Any, comm: Any, full: torch.Tensor, part: torch.Tensor, src: torch.Tensor
) -> dict[tuple[str, str], Callable[[], object]]:
    return {
        ("copy", "copy"): lambda: full.copy_(src),
        ("all_reduce", "gloo"): lambda: comm._gloo_all_reduce(full, "sum", None, False),
        ("all_reduce", "shm"): lambda: acc.all_reduce(full),
        ("reduce_scatter", "gloo"): lambda: comm._gloo_reduce_scatter(
            part, full, "sum", None, False
        ),
        ("reduce_scatter", "shm"): lambda: acc.reduce_scatter(part, full),
        ("all_gather", "gloo"): lambda: comm._gloo_all_gather(full, part, None, False),
        ("all_gather", "shm"): lambda: acc.all_gather(full, part),
        ("broadcast", "gloo"): lambda: comm._gloo_broadcast(full, 0, None, False),
        ("broadcast", "shm"): lambda: acc.broadcast(full, 0),
    }


def _rank(rank: int, world: int, port: int, sizes: list[int], evict_bytes: int, out: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    from ds_backend_cpu import comm, shm_groups

    import ds_core

    ds_core.init_distributed()
    acc = ds_core.get_accelerator()
    acc.barrier()
    protocol = shm_groups.existing(None)
    path = type(protocol.flags).__name__ if protocol else "none (gloo fallback)"
    rows: dict[tuple[str, str, int], tuple[float, float]] = {}
    scratch = torch.ones(evict_bytes // 4)
    for nbytes in sizes:
        n = nbytes // 4
        full, part, src = torch.ones(n), torch.ones(n // world), torch.ones(n)
        cases = _cases(acc, comm, full, part, src)
        times: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in cases}
        for fn in cases.values():  # warm-up: first-touch page faults, caches
            dist.barrier()
            fn()
        for _ in range(_reps(nbytes)):
            for key, fn in cases.items():  # interleaved: machine noise hits every case alike
                # Out of cache, alike for the copy and the collectives: writing the scratch
                # buffer pushes the operands (and the segment's slots) out of L1/L2 and out
                # of as much of the shared L3 as the scratch covers.
                scratch.add_(1.0)
                dist.barrier()
                c0, t0 = time.thread_time(), time.perf_counter()
                fn()
                t = torch.tensor(
                    [time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64
                )
                dist.all_reduce(t, dist.ReduceOp.MAX)  # a collective ends with its slowest rank
                times[key].append((float(t[0]), float(t[1])))
        for (name, transport_name), ts in times.items():
            rows[(name, transport_name, nbytes)] = (
                statistics.median(x[0] for x in ts),
                statistics.median(x[1] for x in ts),
            )
        full.fill_(1.0)
    if rank == 0:
        out.put((path, rows))
    ds_core.comm.destroy_distributed()


P2P_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 32 << 20)


def _p2p_rank(rank: int, port: int, out: Any) -> None:
    """Rank ``rank`` of 2: ping-pongs each size over gloo and over shared memory."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )  # fmt: skip
    torch.set_num_threads(1)
    from ds_backend_cpu import comm, shm_p2p

    import ds_core

    ds_core.init_distributed()
    acc = ds_core.get_accelerator()
    peer = 1 - rank
    gloo = shm_p2p._DEFAULT  # the core's default hooks: torch.distributed over gloo
    transports: dict[str, tuple[Callable[[torch.Tensor], object], ...]] = {
        "gloo": (
            lambda t: gloo.ds_comm_send(t, peer, None, 0, False),
            lambda t: gloo.ds_comm_recv(t, peer, None, 0, False),
        ),
        "shm": (lambda t: acc.send(t, peer), lambda t: acc.recv(t, peer)),
    }

    def pingpong(send: Callable[[torch.Tensor], object], recv: Callable[[torch.Tensor], object],
                 buf: torch.Tensor) -> None:  # fmt: skip
        if rank == 0:
            send(buf)
            recv(buf)
        else:
            recv(buf)
            send(buf)

    rows: dict[tuple[str, int], float] = {}
    for nbytes in P2P_SIZES:
        buf = torch.ones(nbytes // 4)
        trips = max(1, min(200, (16 << 20) // nbytes))
        times: dict[str, list[float]] = {k: [] for k in transports}
        for send, recv in transports.values():  # warm-up; the first sets the channel up
            pingpong(send, recv, buf)
        for _ in range(max(5, _reps(nbytes))):
            for name, (send, recv) in transports.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(trips):
                    pingpong(send, recv, buf)
                times[name].append((time.perf_counter() - t0) / trips / 2)
        for name, ts in times.items():
            rows[(name, nbytes)] = statistics.median(ts)
    shm_sends = comm.transport_counts().get(("send", "shm", ""), 0)
    if rank == 0:
        out.put((shm_sends, rows))
    ds_core.comm.destroy_distributed()


def _p2p_report(shm_sends: int, rows: dict[tuple[str, int], float]) -> None:
    print(f"\n2 ranks, point-to-point ping-pong ({shm_sends} sends went over shared memory)")
    print(
        f"  {'size':>8}  {'gloo us':>9}  {'shm us':>9}  {'gloo/shm':>8}  {'gloo GB/s':>9}"
        f"  {'shm GB/s':>9}"
    )
    for s in P2P_SIZES:
        g, m = rows[("gloo", s)], rows[("shm", s)]
        print(
            f"  {_size(s):>8}  {g * 1e6:9.1f}  {m * 1e6:9.1f}  {g / m:8.2f}  {s / g / 1e9:9.2f}"
            f"  {s / m / 1e9:9.2f}"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _report(world: int, path: str, rows: dict[tuple[str, str, int], tuple[float, float]]) -> None:
    sizes = sorted({k[2] for k in rows})
    print(f"\n{world} ranks, shared-memory sync: {path}; medians, slowest rank per rep")
    print(f"  {'size':>8}  {'copy GB/s':>9}  {'copy cpu GB/s':>13}")
    for s in sizes:
        wall, cpu = rows[("copy", "copy", s)]
        print(f"  {_size(s):>8}  {s / wall / 1e9:9.2f}  {s / max(cpu, 1e-9) / 1e9:13.2f}")
    for name in COLLECTIVES:
        extra = "  rs/ar(shm)" if name == "reduce_scatter" else ""
        print(f"  {name}")
        print(
            f"  {'size':>8}  {'gloo ms':>9}  {'shm ms':>9}  {'gloo/shm':>8}  {'bound ms':>9}"
            f"  {'shm/bound':>9}  {'cpu/bound':>9}{extra}"
        )
        for s in sizes:
            gloo, mem = rows[(name, "gloo", s)][0], rows[(name, "shm", s)]
            copy = rows[("copy", "copy", s)]
            bound, cpu_bound = LOGICAL[name] * copy[0], LOGICAL[name] * max(copy[1], 1e-9)
            line = (
                f"  {_size(s):>8}  {gloo * 1e3:9.3f}  {mem[0] * 1e3:9.3f}  {gloo / mem[0]:8.2f}"
                f"  {bound * 1e3:9.3f}  {mem[0] / bound:9.2f}  {mem[1] / cpu_bound:9.2f}"
            )
            if extra:
                line += f"  {mem[0] / rows[('all_reduce', 'shm', s)][0]:11.2f}"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--min-kib", type=int, default=64)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument(
        "--evict-mib", type=int, default=64,
        help="scratch each rank writes before every timed rep (0: operands stay cached)",
    )  # fmt: skip
    parser.add_argument("--p2p", action="store_true", help="time point-to-point instead")
    args = parser.parse_args()
    if args.p2p:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        print(f"torch {torch.__version__}, {os.cpu_count()} cpus, fp32 buffers, 1 thread per rank")
        mp.spawn(_p2p_rank, args=(port, queue), nprocs=2)
        _p2p_report(*queue.get())
        return
    sizes, s = [], args.min_kib << 10
    while s <= args.max_mib << 20:
        sizes.append(s)
        s *= 4
    if (32 << 20) not in sizes and args.min_kib << 10 <= 32 << 20 <= args.max_mib << 20:
        sizes = sorted([*sizes, 32 << 20])  # the all-reduce target size
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, fp32 buffers, 1 thread per rank")
    for world in (int(w) for w in args.worlds.split(",")):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        queue = ctx.SimpleQueue()
        mp.spawn(_rank, args=(world, port, sizes, args.evict_mib << 20, queue), nprocs=world)
        path, rows = queue.get()
        _report(world, path, rows)


if __name__ == "__main__":
    main()
