"""NVMe offload: the async I/O engine's bandwidth against the disk's own sequential bound,
the host memory a checkpoint save of NVMe-resident state takes, and the GPT example's step
time with host vs NVMe optimizer offload, in one run.

Run: ``python bench/nvme.py`` (about 8 minutes here), ``--dir`` for the folder under test
(default ``/tmp``: keep it on a real disk, not tmpfs), ``--no-steps`` to skip the training
part, ``--preset small`` for a quick look at it.

1. Bandwidth, per request size (1-256 MiB): ``256 MiB / size`` requests (at least one) are
   written into one file, then read back, through :class:`ds_core.io.AsyncIO` (the ``aio``
   defaults: 1 MiB blocks, queue depth 8 blocks in flight per intra-op thread; ``--threads``
   the ``intra_op_parallelism`` values, one table each, default 1 (DeepSpeed's default: 8
   blocks in flight) and 4 (32)), and
   the same bytes with plain sequential ``O_DIRECT`` ``pwrite``/``pread`` of the same size in
   one thread (``dd ... bs=<size> oflag=direct``'s I/O pattern): the bound. The page cache is
   dropped (``/proc/sys/vm/drop_caches``, where permitted) before every read; writes end with
   ``fsync`` on both sides. Each cell is the median of ``--repeat`` runs, interleaved.
2. Save memory: one process, the ``large`` GPT with ``offload_optimizer: nvme``
   (``sub_group_size`` 4 M elements), one step, then ``save_checkpoint`` with a thread
   sampling the resident set every millisecond (and the kernel's ``VmHWM``, reset before
   the save): peak above the resident set before the save, against one sub-group's buffer
   (3 x 4 bytes x sub_group_size) and against the state's size.
3. Kernel asynchronous I/O against the engine's thread pool (``--no-kaio`` skips it): the
   same requests (1-256 MiB, 256 MiB in all, 1 MiB blocks, 8 in flight, ``O_DIRECT``,
   page-aligned buffers) through Linux native AIO from one thread (``bench/kernel_aio.c``,
   raw ``io_submit``/``io_getevents`` syscalls, built like ``ds_core.ops``' kernels) and
   through :class:`ds_core.io.AsyncIO` (compiled pool): MiB/s and the process's CPU seconds
   per GiB moved (on a machine whose cores are all busy with training, the I/O's CPU time
   is what shows in the step), medians of ``--repeat``, interleaved, page cache dropped
   before reads.
4. Where the NVMe step waits (``--only-waits``: this section alone): 2 ranks, the GPT
   (``--preset``), stages 2 and 3, host then NVMe optimizer offload interleaved, ``--steps``
   + 2 warm-up steps each: median wall and CPU time (the process's, every thread) of the
   step and of ``engine.step()``, and where the NVMe ``step()`` went, printed per step
   (``NvmeOptimizerOffload.step_seconds``: the swap-in and write-back waits, the Adam kernel,
   the copy to the units, the write submits); ``--buffer-count`` and ``--sub-group-size`` set
   the NVMe configuration.
5. Step time: ``bench/zero_vs_peers.py``'s table for ``ds2_off,ds2_nvme,ds3_off,ds3_nvme``.

It prints and never asserts.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MiB = 1 << 20
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOTAL = 256 * MiB


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def plain(path: str, size: int, count: int, write: bool) -> float:
    """Seconds for ``count`` sequential ``O_DIRECT`` requests of ``size`` bytes, one thread."""
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(b"\1" * size)  # touched: page faults are no part of the I/O
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT
    fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(count):
            if write:
                n = os.pwritev(fd, [buf], i * size)
            else:
                n = os.preadv(fd, [buf], i * size)
            if n != size:
                raise OSError(f"short {'write' if write else 'read'} on {path}: {n} of {size}")
        if write:
            os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()


def engine(
    io: object, path: str, tensors: list[torch.Tensor], size: int, count: int, write: bool
) -> float:
    """Seconds for ``count`` requests of ``size`` bytes through the engine, all submitted
    (from/into ``tensors`` in turn: touched beforehand, as a swap buffer is)."""
    t0 = time.perf_counter()
    for i in range(count):
        t = tensors[i % len(tensors)]
        if write:
            io.submit_write(t, path, i * size)  # type: ignore[attr-defined]
        else:
            io.submit_read(t, path, i * size)  # type: ignore[attr-defined]
    io.wait()  # type: ignore[attr-defined]
    if write:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def bandwidth(folder: str, repeat: int, threads: int) -> None:
    from ds_core.io import AsyncIO, direct_supported, io_status

    io = AsyncIO(intra_op_parallelism=threads)
    dropped = drop_caches()
    print(f"folder {folder}: O_DIRECT {'yes' if direct_supported(folder) else 'no'}; engine: "
          f"{io_status()}; block 1 MiB, queue depth 8, intra_op_parallelism {threads}: "
          f"{io.blocks_in_flight} blocks in flight per request; page "
          f"cache {'dropped before reads' if dropped else 'NOT dropped (no permission)'}")  # fmt: skip
    print(f"{'request':>8} {'n':>4} {'write MiB/s':>12} {'bound':>8} {'ratio':>6}"
          f" {'read MiB/s':>11} {'bound':>8} {'ratio':>6}")  # fmt: skip
    path = os.path.join(folder, "ds_core_bench_nvme.bin")
    try:
        for size_mib in SIZES:
            size, count = size_mib * MiB, max(1, TOTAL // (size_mib * MiB))
            cells: dict[str, list[float]] = {k: [] for k in ("ew", "pw", "er", "pr")}
            tensors = [torch.ones(size, dtype=torch.uint8) for _ in range(min(count, 4))]
            for _ in range(repeat):  # interleaved: the machine's speed drifts
                cells["pw"].append(plain(path, size, count, write=True))
                cells["ew"].append(engine(io, path, tensors, size, count, write=True))
                drop_caches()
                cells["pr"].append(plain(path, size, count, write=False))
                drop_caches()
                cells["er"].append(engine(io, path, tensors, size, count, write=False))
            mbs = {k: size * count / MiB / statistics.median(v) for k, v in cells.items()}
            print(f"{size_mib:>5} MiB {count:>4} {mbs['ew']:>12.0f} {mbs['pw']:>8.0f} "
                  f"{mbs['ew'] / mbs['pw']:>6.2f} {mbs['er']:>11.0f} {mbs['pr']:>8.0f} "
                  f"{mbs['er'] / mbs['pr']:>6.2f}")  # fmt: skip
            sys.stdout.flush()
            del tensors
    finally:
        io.close()
        if os.path.exists(path):
            os.remove(path)


_SAVE = r"""
import os, sys, threading, time
import torch
sys.path.insert(0, sys.argv[3])
import ds_core
from examples.gpt import GPT, PRESETS
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
torch.set_num_threads(1)
folder, sub = sys.argv[1], 4_000_000
model = GPT(PRESETS["large"])
cfg = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
       "steps_per_print": 10**9, "log_level": "warning",
       "zero_optimization": {"stage": 2, "sub_group_size": sub, "offload_optimizer": {
           "device": "nvme", "nvme_path": folder}}}
engine, _, _, _ = ds_core.initialize(model=model, config=cfg)
x = torch.randint(0, model.cfg.vocab_size, (1, 64))
engine.backward(engine(x, x)); engine.step()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before, peak, stop = rss(), [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.001)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter()
engine.save_checkpoint(os.path.join(folder, "ckpt"))
secs = time.perf_counter() - t0
stop.set(); t.join()
with open("/proc/self/status") as f:
    hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
n = sum(p.numel() for p in model.parameters())
print(f"save of {n / 1e6:.1f} M parameters' NVMe state ({12 * n / 2**20:.0f} MiB) in {secs:.1f} s: "
      f"peak RSS +{(max(peak[0], hwm) - before) / 2**20:.0f} MiB above the {before / 2**20:.0f} MiB "
      f"before the save (sampled +{(peak[0] - before) / 2**20:.0f} MiB); one sub-group buffer "
      f"{12 * sub / 2**20:.0f} MiB")
engine.destroy()
"""


def save_memory(folder: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory(dir=folder, prefix="ds_core_bench_save_") as work:
        env = dict(os.environ, DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536")
        out = subprocess.run([sys.executable, "-c", _SAVE, work, port, str(ROOT)], env=env,
                             capture_output=True, text=True)  # fmt: skip
        print(out.stdout.strip() or out.stderr[-3000:])


def kernel_aio(folder: str, repeat: int) -> None:
    import ctypes

    from ds_core.io import AsyncIO
    from ds_core.ops._build import build_shared_library

    lib = build_shared_library("bench_kernel_aio", [ROOT / "bench" / "kernel_aio.c"],
                               cflags=("-std=c11", "-Wall"), quiet=True)  # fmt: skip
    fn = lib.kaio_transfer
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int]  # fmt: skip
    fn.restype = ctypes.c_int
    path = os.path.join(folder, "ds_core_bench_kaio.bin")

    def fsync() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def kaio(addr: int, size: int, count: int, write: bool) -> None:
        for i in range(count):
            rc = fn(path.encode(), int(write), addr, size, i * size, MiB, 8)
            if rc:
                raise OSError(-rc, f"kernel AIO on {path}: {os.strerror(-rc)}")
        if write:
            fsync()

    def pool(t: torch.Tensor, size: int, count: int, write: bool) -> None:
        for i in range(count):
            (io.submit_write if write else io.submit_read)(t, path, i * size)
        io.wait()
        if write:
            fsync()

    def timed(run: Any, *a: Any) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        run(*a)
        return time.perf_counter() - w, time.process_time() - c

    io = AsyncIO(implementation="compiled")
    print(f"kernel {os.uname().release}; Linux native AIO from one thread vs the compiled "
          f"pool, both 1 MiB blocks x 8 in flight, O_DIRECT; load average "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}")  # fmt: skip
    print(f"{'request':>8} {'op':>5} {'pool MiB/s':>11} {'kaio MiB/s':>11} {'kaio/pool':>9} "
          f"{'pool cpu s/GiB':>15} {'kaio cpu s/GiB':>15}")  # fmt: skip
    try:
        for size_mib in (1, 8, 64, 256):
            size, count = size_mib * MiB, TOTAL // (size_mib * MiB)
            buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
            buf.write(b"\1" * size)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            t = torch.frombuffer(buf, dtype=torch.uint8)
            cells: dict[str, list[tuple[float, float]]] = {k: [] for k in ("pw", "kw", "pr", "kr")}
            for _ in range(repeat):  # interleaved
                cells["pw"].append(timed(pool, t, size, count, True))
                cells["kw"].append(timed(kaio, addr, size, count, True))
                drop_caches()
                cells["pr"].append(timed(pool, t, size, count, False))
                drop_caches()
                cells["kr"].append(timed(kaio, addr, size, count, False))
            gib = TOTAL / (1 << 30)
            for op, p, k in (("write", "pw", "kw"), ("read", "pr", "kr")):
                pw, kw = (statistics.median(x[0] for x in cells[c]) for c in (p, k))
                pc, kc = (statistics.median(x[1] for x in cells[c]) for c in (p, k))
                print(f"{size_mib:>5} MiB {op:>5} {TOTAL / MiB / pw:>11.0f} "
                      f"{TOTAL / MiB / kw:>11.0f} {pw / kw:>9.2f} {pc / gib:>15.3f} "
                      f"{kc / gib:>15.3f}", flush=True)  # fmt: skip
            del t  # the buffer closes only once no view is left
            buf.close()
    finally:
        io.close()
        if os.path.exists(path):
            os.remove(path)


def _waits_rank(rank: int, stage: int, device: str, port: int, preset: str, steps: int,
                folder: str, buffers: int, sub_group: int) -> None:  # fmt: skip
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    import ds_core
    from examples.gpt import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    off: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        off["nvme_path"] = folder
        if buffers:
            off["buffer_count"] = buffers
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0,
                            "reduce_bucket_size": 6_000_000, "offload_optimizer": off}  # fmt: skip
    if sub_group:
        zero["sub_group_size"] = sub_group
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.0}},
           "steps_per_print": 10**9, "log_level": "warning", "zero_optimization": zero}  # fmt: skip
    engine, *_ = ds_core.initialize(model=model, config=cfg)
    secs: dict[str, float] | None = getattr(engine.offload, "step_seconds", None)
    g = torch.Generator().manual_seed(rank)
    rows: list[tuple[float, ...]] = []
    for i in range(steps + 2):
        x = torch.randint(0, model.cfg.vocab_size, (1, 64), generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        engine.backward(engine(x, x))
        t1, c1 = time.perf_counter(), time.process_time()
        engine.step()
        t2, c2 = time.perf_counter(), time.process_time()
        s = secs or {}
        row = (t2 - t0, c2 - c0, t2 - t1, c2 - c1, s.get("swap_in_s", 0.0),
               s.get("swap_out_s", 0.0), s.get("update_s", 0.0), s.get("publish_s", 0.0),
               s.get("write_s", 0.0))  # fmt: skip
        if i >= 2:
            rows.append(row)
        if rank == 0 and secs is not None:
            print(f"  stage {stage} nvme step {i}: " + _fmt(row), flush=True)
        if secs is not None:
            secs.update(dict.fromkeys(secs, 0.0))
    if rank == 0:
        subs = len(getattr(engine.offload, "sub_groups", []))
        med = tuple(statistics.median(r[k] for r in rows) for k in range(len(rows[0])))
        print(f"stage {stage} {device:>4}: " + _fmt(med) + f" (medians of {steps})"
              + (f"; {subs} sub-groups" if subs else ""), flush=True)  # fmt: skip
    engine.destroy()
    dist.destroy_process_group()


def _fmt(row: tuple[float, ...]) -> str:
    """One step's seconds: wall and CPU (this process, every thread) of the whole step and of
    ``engine.step()``, then where ``step()`` went (NVMe only)."""
    names = ("step", "cpu", "step()", "cpu", "swap-in wait", "write-back wait", "adam",
             "publish", "write submit")  # fmt: skip
    return ", ".join(f"{n} {1e3 * v:.0f}" for n, v in zip(names, row, strict=True)) + " ms"


def step_waits(folder: str, preset: str, steps: int, buffers: int, sub_group: int) -> None:
    import socket

    import torch.multiprocessing as mp

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    for stage in (2, 3):
        for device in ("cpu", "nvme"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_waits_rank, nprocs=2,
                     args=(stage, device, port, preset, steps, folder, buffers, sub_group))  # fmt: skip
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="folder under test (a real disk)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--threads", default="1,4", help="aio intra_op_parallelism values, one table each"
    )
    ap.add_argument("--no-steps", action="store_true", help="skip the training step times")
    ap.add_argument("--no-kaio", action="store_true", help="skip kernel AIO vs the pool")
    ap.add_argument("--only-kaio", action="store_true", help="only kernel AIO vs the pool")
    ap.add_argument("--only-waits", action="store_true", help="only the NVMe step's waits")
    ap.add_argument("--preset", default="large", help="GPT preset for the step times")
    ap.add_argument("--rounds", default="1")
    ap.add_argument("--steps", default="3")
    ap.add_argument(
        "--buffer-count",
        type=int,
        default=0,
        help="--only-waits: offload_optimizer.buffer_count (0: the default)",
    )
    ap.add_argument(
        "--sub-group-size",
        type=int,
        default=0,
        help="--only-waits: zero_optimization.sub_group_size (0: the default)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.only_waits:
        print("## where the NVMe step waits")
        step_waits(args.dir, args.preset, int(args.steps), args.buffer_count, args.sub_group_size)
        return
    if args.only_kaio:
        print("## kernel asynchronous I/O vs the thread pool")
        kernel_aio(args.dir, args.repeat)
        return
    print("## I/O engine vs plain sequential O_DIRECT I/O")
    for threads in (int(t) for t in args.threads.split(",")):
        bandwidth(args.dir, args.repeat, threads)
    print("\n## host memory of a save of NVMe-resident optimizer state")
    save_memory(args.dir)
    if not args.no_kaio:
        print("\n## kernel asynchronous I/O vs the thread pool")
        kernel_aio(args.dir, args.repeat)
    if args.no_steps:
        return
    print("\n## GPT step time: host vs NVMe optimizer offload")
    os.environ["DS_CORE_BENCH_NVME_DIR"] = args.dir
    from bench import zero_vs_peers

    zero_vs_peers.main(["--configs", "ds2_off,ds2_nvme,ds3_off,ds3_nvme", "--preset",
                        args.preset, "--rounds", args.rounds, "--steps", args.steps])  # fmt: skip


if __name__ == "__main__":
    main()
