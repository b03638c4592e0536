"""Shared-memory segments for the ranks of one process group on one host.

[Note: segment lifetime]
The group's first rank creates ``/dev/shm/ds_core-shm-<128 random bits>`` with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, reserves its pages (``posix_fallocate``, so a
full tmpfs is an error now rather than a SIGBUS later) and tells the peers its name over the
group's gloo transport. Each peer opens it, checks that it is a regular file owned by this user
with mode 0600 and the announced size, and maps it. As soon as every rank has reported its
attach (one gloo all-gather), the name is unlinked: the mapping lives on in each process and
disappears with the last one, so a rank killed with SIGKILL afterwards leaves nothing in
``/dev/shm``. Every failure path unlinks too; the only window that can leak a name is a kill
of the creator between the create and the attach report, a few milliseconds at group setup.

[Note: layout]
``| control block of rank 0 | ... | control block of rank W-1 | data slots |``. A control block
(64-byte aligned) holds, each on its own cache line, the
rank's arrival counter (the only word other ranks wait on), its pid, and two alternating
metadata records (by call parity) describing the call it has posted. Data slots: two per rank
(by step parity, parity-major), each :attr:`Segment.slot_bytes` long. Why two of each: see
[Note: protocol] in :mod:`ds_backend_cpu.shm`.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from dataclasses import dataclass

import torch

PREFIX = "ds_core-shm-"
SHM_DIR = "/dev/shm"
ALIGN = 64

# Control block, in 8-byte words: the counter alone on the first cache line, the pid and the
# sleeper count on the second, then two metadata records (by call parity) of META_WORDS fixed words followed by the
# rank's all-to-all send and receive row counts (2 x world words).
COUNTER_WORD = 0
PID_WORD = 8
SLEEPERS_WORD = 9  # peers asleep on this rank's counter (C helper only)
RECORD_WORD = 16
META_WORDS = 24


def host_key() -> str:
    """A string equal for two processes only when they share a host, pid space and /dev/shm.

    Boot id (the kernel instance), the pid namespace (liveness checks use pids) and the
    device and inode of ``/dev/shm`` (the segment must be the same file for both).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
        shm = os.stat(SHM_DIR)
    except OSError as exc:
        return f"unknown:{os.getpid()}:{exc.errno}"  # never equal to a peer's: gloo it is
    return f"{boot}:{pid_ns}:{shm.st_dev}:{shm.st_ino}"


def _round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets in a segment for ``world`` ranks with ``slot_bytes`` per data slot."""

    world: int
    slot_bytes: int

    @property
    def record_words(self) -> int:
        return META_WORDS + 2 * self.world

    @property
    def ctrl_stride(self) -> int:
        return _round_up((RECORD_WORD + 2 * self.record_words) * 8)

    @property
    def data_offset(self) -> int:
        return _round_up(self.ctrl_stride * self.world, 4096)

    @property
    def size(self) -> int:
        return self.data_offset + 2 * self.world * self.slot_bytes

    def slot_offset(self, rank: int, parity: int) -> int:
        # Parity-major, so one parity's slots form a strided (world, slot) view.
        return self.data_offset + (parity * self.world + rank) * self.slot_bytes


class SegmentError(RuntimeError):
    """A segment could not be created, attached or verified."""


class Segment:
    """One mapped segment: raw bytes as a uint8 tensor plus a uint64 view of the controls."""

    def __init__(self, path: str, fd: int, layout: Layout) -> None:
        self.path, self.layout = path, layout
        try:
            self._mm = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.words = memoryview(self._mm).cast("Q")  # aligned 8-byte loads and stores
        self.unlinked = False

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    def address(self) -> int:
        """The mapping's base address, for the C sync helper."""
        return int(self.bytes.data_ptr())

    def word_index(self, rank: int, word: int) -> int:
        return (rank * self.layout.ctrl_stride) // 8 + word

    def slots(self, parity: int, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's data slot ``parity`` as a ``(world, slot_bytes / itemsize)`` view."""
        lay = self.layout
        start = lay.slot_offset(0, parity)
        raw = self.bytes[start : start + lay.world * lay.slot_bytes].view(lay.world, lay.slot_bytes)
        return raw.view(dtype)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid). Idempotent."""
        if not self.unlinked:
            self.unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def create(layout: Layout) -> Segment:
    """Create and map a new segment owned by this user, mode 0600, with an unguessable name.

    :raises SegmentError: when the file cannot be created or its pages reserved.
    """
    path = os.path.join(SHM_DIR, PREFIX + secrets.token_hex(16))
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise SegmentError(f"cannot create {path}: {exc}") from exc
    try:
        os.fchmod(fd, 0o600)  # the umask could only narrow it, but say what we mean
        os.posix_fallocate(fd, 0, layout.size)
    except OSError as exc:
        os.close(fd)
        _unlink_quietly(path)
        raise SegmentError(
            f"cannot reserve {layout.size} bytes in {SHM_DIR} ({exc}); free space there or "
            "lower DS_CPU_SHM_SLOT_BYTES"
        ) from exc
    try:
        return Segment(path, fd, layout)
    except Exception:
        _unlink_quietly(path)
        raise


def attach(path: str, layout: Layout) -> Segment:
    """Open and map a peer's segment after checking that only this user can reach it.

    :raises SegmentError: naming the check that failed (not under /dev/shm, not a regular file,
        another owner, a mode other than 0600, or a size other than announced).
    """
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise SegmentError(f"refusing to attach {path!r}: not a ds_core segment in {SHM_DIR}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SegmentError(f"cannot open {path}: {exc}") from exc
    st = os.fstat(fd)
    problem = ""
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not this user ({os.getuid()})"
    elif stat.S_IMODE(st.st_mode) != 0o600:
        problem = f"mode {stat.S_IMODE(st.st_mode):o}, expected 600"
    elif st.st_size != layout.size:
        problem = f"{st.st_size} bytes, expected {layout.size}"
    if problem:
        os.close(fd)
        raise SegmentError(f"refusing to attach {path}: {problem}")
    return Segment(path, fd, layout)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def leftover_segments() -> list[str]:
    """Names of this package's segments currently in ``/dev/shm`` (for tests and reports)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except OSError:
        return []
