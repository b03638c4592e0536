"""ds_core.io: round trips of unaligned tensors, both implementations, O_DIRECT and not,
errors that name the file and the operation, and no descriptor leaked over 1,000 swaps.

Files go to a real file system folder (pytest's tmp_path, or ``DS_CORE_NVME_TEST_DIR``), and
also to /dev/shm where present (tmpfs: O_DIRECT is refused on older kernels)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_core.io import AsyncIO, AsyncIOError, direct_supported, io_status
from ds_core.io._engine import MAX_BLOCKS_IN_FLIGHT, _Python

IMPLS = ["compiled", "python"]


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    root = os.environ.get("DS_CORE_NVME_TEST_DIR")
    return Path(tempfile.mkdtemp(dir=root)) if root else tmp_path


@pytest.fixture
def folders(disk: Path) -> Iterator[list[Path]]:
    """``disk``, and a folder in /dev/shm where it is writable (removed after the test: a
    tmpfs folder left behind holds memory until reboot)."""
    out = [disk]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        out.append(Path(tempfile.mkdtemp(dir="/dev/shm")))
    yield out
    if len(out) > 1:
        shutil.rmtree(out[1], ignore_errors=True)


def _fds() -> int:
    """Descriptors this process holds for more than a moment: the fewest of five counts (another
    thread of the test process may hold one while it reads a file; a leaked one stays)."""
    return min(len(os.listdir("/proc/self/fd")) for _ in range(5))


def _open_in(folder: Path) -> list[str]:
    """What this process's descriptors refer to inside ``folder``."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith(str(folder.resolve())):
                out.append(target)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direct", [None, False])
def test_unaligned_tensors_round_trip_exactly(
    folders: list[Path], impl: str, direct: bool | None
) -> None:
    for folder in folders:
        h = AsyncIO(block_size=8192, queue_depth=3, intra_op_parallelism=3, thread_count=2,
                    use_direct=direct, implementation=impl)  # fmt: skip
        cases = [(12289, torch.bfloat16), (4096, torch.float32), (7, torch.float32),
                 (100_003, torch.float16), (1, torch.bfloat16)]  # fmt: skip
        srcs, outs = [], []
        for i, (n, dt) in enumerate(cases):
            src = torch.randn(n + 1).to(dt)[1:]  # odd size and an address off alignment
            srcs.append(src)
            h.submit_write(src, folder / f"f{i}", offset=4096 * i)
        assert h.wait() == len(cases)
        for i, src in enumerate(srcs):
            out = torch.empty(src.numel() + 3, dtype=src.dtype)[3:]
            outs.append(out)
            h.submit_read(out, folder / f"f{i}", offset=4096 * i)
        h.wait()
        for src, out in zip(srcs, outs, strict=True):
            assert torch.equal(src, out)
        h.close()


@pytest.mark.parametrize(("depth", "intra"), [(8, 1), (4, 2), (1, 1)])
def test_a_request_keeps_queue_depth_blocks_in_flight(
    disk: Path, monkeypatch: pytest.MonkeyPatch, depth: int, intra: int
) -> None:
    # Every block call of the Python twin waits at a barrier of depth x intra parties, so it
    # passes only when that many calls are active together: an engine issuing fewer at once
    # breaks it (the timeout is a hang guard, not a measurement). The peak shows no more run.
    want = depth * intra
    barrier = threading.Barrier(want, timeout=120)
    lock = threading.Lock()
    active, peak, calls = [0], [0], [0]
    real = _Python._move

    def counted(fd: int, fd_buf: int, write: bool, view: memoryview, off: int) -> int:
        with lock:
            active[0] += 1
            calls[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            barrier.wait()
            return real(fd, fd_buf, write, view, off)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(_Python, "_move", staticmethod(counted))
    h = AsyncIO(block_size=4096, queue_depth=depth, intra_op_parallelism=intra,
                use_direct=False, implementation="python")  # fmt: skip
    assert h.blocks_in_flight == want
    src = torch.randn(3 * want * 1024)  # three rounds of `want` 4 KiB blocks
    back = torch.empty_like(src)
    h.sync_write(src, disk / "qd.bin")
    h.sync_read(back, disk / "qd.bin")
    h.close()
    assert torch.equal(src, back)
    assert calls[0] == 2 * 3 * want and peak[0] == want


def test_blocks_in_flight_are_capped() -> None:
    h = AsyncIO(queue_depth=64, intra_op_parallelism=4, implementation="python")
    assert h.blocks_in_flight == MAX_BLOCKS_IN_FLIGHT
    h.close()


def test_direct_probe_on_a_real_disk(disk: Path) -> None:
    # Whatever the answer, it is a boolean and the probe leaves nothing behind.
    assert direct_supported(disk) in (True, False)
    assert not [p for p in os.listdir(disk) if p.startswith(".ds_core_direct_probe")]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_short_file_is_an_error_naming_it(disk: Path, impl: str) -> None:
    h = AsyncIO(block_size=4096, intra_op_parallelism=2, implementation=impl)
    f = disk / "short.bin"
    h.sync_write(torch.ones(1000), f)
    with pytest.raises(AsyncIOError, match=r"read of 8000 bytes at offset 0 of .*short\.bin.*"
                       r"short read, the file ends at byte 4000"):  # fmt: skip
        h.sync_read(torch.empty(2000), f)
    with pytest.raises(AsyncIOError, match=r"read .*missing\.bin.* opening the file.*No such"):
        h.sync_read(torch.empty(10), disk / "missing.bin")
    with pytest.raises(AsyncIOError, match=r"write .*nofolder.* opening the file"):
        h.sync_write(torch.empty(10), disk / "nofolder" / "x.bin")
    h.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
@pytest.mark.parametrize("impl", IMPLS)
def test_permission_is_an_error_naming_the_file(disk: Path, impl: str) -> None:
    ro = disk / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    h = AsyncIO(implementation=impl)
    with pytest.raises(AsyncIOError, match=r"write .*ro/x\.bin.*Permission denied"):
        h.sync_write(torch.ones(10), ro / "x.bin")
    h.close()


_FULL = """
import resource, signal, sys, torch
from ds_core.io import AsyncIO, AsyncIOError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
h = AsyncIO(block_size=8192, intra_op_parallelism=2, implementation=sys.argv[2])
try:
    h.sync_write(torch.ones(1 << 16), sys.argv[1])
except AsyncIOError as exc:
    print("ERR", exc)
h.close()
"""


@pytest.mark.parametrize("impl", IMPLS)
def test_a_full_disk_is_an_error_naming_the_file(disk: Path, impl: str) -> None:
    # RLIMIT_FSIZE stands in for a full disk (EFBIG where ENOSPC would come).
    out = subprocess.run([sys.executable, "-c", _FULL, str(disk / "big.bin"), impl],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert "write of 262144 bytes at offset 0 of" in out.stdout, out.stdout + out.stderr
    assert "big.bin" in out.stdout and "File too large" in out.stdout


@pytest.mark.parametrize("impl", IMPLS)
def test_descriptors_are_flat_over_1000_swap_cycles(disk: Path, impl: str) -> None:
    h = AsyncIO(block_size=4096, queue_depth=4, intra_op_parallelism=2, thread_count=2,
                implementation=impl)  # fmt: skip
    buf, back = torch.randn(3001), torch.empty(3001)
    h.sync_write(buf, disk / "w.bin")
    h.sync_read(back, disk / "w.bin")
    start = _fds()
    for i in range(1000):
        h.submit_write(buf, disk / "w.bin")
        h.wait()
        h.submit_read(back, disk / "w.bin")
        h.wait()
        if i % 100 == 0:  # failures close their descriptors too
            with pytest.raises(AsyncIOError):
                h.sync_read(torch.empty(10_000), disk / "w.bin")
            assert _open_in(disk) == []
    assert _fds() == start
    assert torch.equal(buf, back)
    h.close()


def test_report_names_the_active_implementation() -> None:
    AsyncIO(implementation="python").close()
    status = io_status()
    assert "pread" in status or "Python" in status
    env = dict(os.environ, DS_CORE_ASYNC_IO="python", DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-m", "ds_core.cli", "report"], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert "async I/O        pure-Python path (DS_CORE_ASYNC_IO=python)" in out.stdout, out


@pytest.mark.parametrize("impl", IMPLS)
def test_a_request_after_a_slow_write_sees_its_bytes_and_a_failed_one_cancels_it(
    disk: Path, impl: str
) -> None:
    path = disk / "after.bin"
    with AsyncIO(implementation=impl, thread_count=2) as h:  # type: ignore[arg-type]
        inner = h.impl
        gate = threading.Event()

        def held_write(p: str, write: bool, *rest: object) -> None:
            if write:
                gate.wait(10)  # the write cannot finish before the read is queued
            inner(p, write, *rest)  # type: ignore[arg-type]

        h.impl = held_write  # type: ignore[assignment]
        src = torch.arange(5000, dtype=torch.float32)
        w = h.submit_write(src, path)
        back = torch.zeros(5000)
        r = h.submit_read(back, path, after=[w])
        assert not r.done()  # queued behind the write, on the second worker
        gate.set()
        r.result(timeout=30)
        assert torch.equal(back, src)
        # A failed write cancels what waits for it; both are reported, the write first.
        bad = h.submit_write(src, disk / "no_such_folder" / "x.bin")
        r2 = h.submit_read(back, path, after=[bad])
        with pytest.raises(AsyncIOError, match="not started: a request it waits for failed"):
            r2.result(timeout=30)
        with pytest.raises(AsyncIOError, match="no_such_folder"):
            h.wait()
