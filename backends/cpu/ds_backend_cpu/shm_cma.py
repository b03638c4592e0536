"""Single-copy reads between the ranks of a host: Linux cross-memory attach (``process_vm_readv``).

[Note: single-copy collectives]
Through the shared segment every byte is copied twice: the owner copies it into its slot and
each reader copies it out. With ``process_vm_readv(2)`` a reader copies straight from the
owner's tensor into its own, once. The owner publishes its buffer's address in its control
block (:data:`ds_backend_cpu.shm_segment.ADDR_WORD`) before the call's first step; after that
step each reader reads what it needs; a second step ("every reader is done") comes before any
rank returns, so no owner changes its buffer while a peer still reads it. All-gather uses it
above :func:`min_bytes`: each rank reads its peers' inputs into its output, one copy of
(world - 1) / world of the output instead of the slots' (world + 1) / world.

Why only all-gather: the kernel's copy is slower per byte than ``memcpy`` (it pins each of the
peer's 4 KiB pages before copying it: 3.6-4.9 GB/s against 4.9-6.0 for ``copy_`` at 4-32 MiB
on this project's 2-core VM, 4.6-5.9 against 5.6-6.4 with torch's transparent huge pages,
``THP_MEM_ALLOC_ENABLE=1``), so it pays only where it removes a whole copy from the slowest
rank. A broadcast's slowest rank copies the buffer once either way (single-copy: the reader;
slots: root in, peers out, in parallel), and a reduce-scatter read a piece at a time into a
cached scratch saves only the slot write. Measured on 2 ranks (bench/cpu_collectives.py, CPU
time over the copy bound at 4/16/32/64 MiB, slots then single-copy): broadcast 2.16/1.57/1.60/
1.29 then 2.13/1.89/1.67/1.80; reduce-scatter 2.01/1.85/2.12/1.93 then 2.34/1.96/1.71/1.88;
all-gather 2.42/2.02/2.00/1.72 then 2.07/1.70/1.39/1.56. So the first two keep the slots.

Whether it works is decided once per group at setup, on every rank alike: each rank offers a
token in its own memory (:func:`offer`) and reads every peer's (:func:`probe`). Linux allows
the read when the reader may ptrace the owner: same user, and under Yama's ``ptrace_scope``
1 ("relational") only from an ancestor or a declared ptracer. Ranks are siblings, so under
scope 1 each rank declares its parent process (``prctl(PR_SET_PTRACER, getppid())``): the
launcher and its descendants, the sibling ranks, may then read it; nothing wider is allowed.
Scope 2 leaves it to ``CAP_SYS_PTRACE`` (the probe tells), scope 3 forbids it, and a container
whose seccomp profile denies the call fails the probe with ``EPERM``/``ENOSYS``. A group whose
probe fails, or whose reads later fail on any rank, uses the slots; the reason is kept
(:func:`status`, shown by ``ds-core report`` under the ``shm_sync`` op).
``DS_CPU_SHM_CMA=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

ENV_CMA = "DS_CPU_SHM_CMA"
ENV_MIN = "DS_CPU_SHM_CMA_MIN_BYTES"
#: Below this many bytes per call the slots win: a single-copy call always takes two steps.
DEFAULT_MIN_BYTES = 256 << 10
YAMA = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_TOKEN = 16


class CmaError(OSError):
    """A cross-memory read failed (the errno says why)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_lock = threading.Lock()
_fn: object = None  # the libc function, or a string saying why there is none
_groups_on = 0
_last_off = ""


def enabled() -> bool:
    return os.environ.get(ENV_CMA, "1").lower() not in ("0", "false", "off", "no")


def min_bytes() -> int:
    """Bytes per call from which a collective reads single-copy (``DS_CPU_SHM_CMA_MIN_BYTES``).

    :raises ValueError: when the variable is not a non-negative integer.
    """
    value = os.environ.get(ENV_MIN, "")
    if not value:
        return DEFAULT_MIN_BYTES
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV_MIN} must be a non-negative number of bytes, got {value!r}")
    return n


def _libc_fn() -> object:
    global _fn
    with _lock:
        if _fn is None:
            if not sys.platform.startswith("linux"):
                _fn = f"process_vm_readv is Linux-only (this is {sys.platform})"
            else:
                try:
                    f = ctypes.CDLL(None, use_errno=True).process_vm_readv
                except (OSError, AttributeError) as exc:
                    _fn = f"libc has no process_vm_readv ({exc})"
                else:
                    f.restype = ctypes.c_ssize_t
                    f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                  ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
                    _fn = f
        return _fn


def read(pid: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` of process ``pid`` to ``dst`` in this process.

    The GIL is released during the copy (ctypes does so for every foreign call).

    :raises CmaError: with the errno when the kernel refuses or the range is not mapped.
    """
    fn = _libc_fn()
    if isinstance(fn, str):
        raise CmaError(errno.ENOSYS, fn)
    local, remote = _IoVec(), _IoVec()
    done = 0
    while done < nbytes:  # a read can stop short at a page boundary: go on from there
        local.base, local.len = dst + done, nbytes - done
        remote.base, remote.len = src + done, nbytes - done
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # type: ignore[operator]
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EIO
            raise CmaError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        done += got


def ptrace_scope() -> int | None:
    """Yama's ``ptrace_scope`` (0-3), or ``None`` when the kernel has no Yama."""
    try:
        with open(YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


@dataclass
class Offer:
    """What a rank hands its peers at setup: its pid and a token in its memory to read."""

    pid: int
    address: int
    token: bytes
    min_bytes: int


def offer(threshold: int, scope: int | None = None) -> tuple[Offer | str, object]:
    """This rank's offer (with its ``threshold``, :func:`min_bytes`), and the buffer that holds its token (keep it alive until every peer
    probed), or a reason when single-copy reads are off here.

    Under Yama scope 1 this declares the parent process as this rank's ptracer (see the
    module docstring).
    """
    if not enabled():
        return f"{ENV_CMA}=0", None
    fn = _libc_fn()
    if isinstance(fn, str):
        return fn, None
    scope = ptrace_scope() if scope is None else scope
    if scope is not None and scope >= 3:
        return f"Yama ptrace_scope={scope} forbids reading another process", None
    if scope == 1:
        parent = os.getppid()
        if parent <= 1:
            return "Yama ptrace_scope=1 and this rank has no launcher parent to declare", None
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(parent), 0, 0, 0) != 0:
            code = ctypes.get_errno()
            return f"prctl(PR_SET_PTRACER) failed: {os.strerror(code)}", None
    token = secrets.token_bytes(_TOKEN)
    buf = ctypes.create_string_buffer(token, _TOKEN)
    return Offer(os.getpid(), ctypes.addressof(buf), token, threshold), buf


def probe(offers: Sequence[Offer | str], me: int, ranks: Sequence[int]) -> str:
    """Read every peer's token; "" when all reads return it, else why not (first failure)."""
    for r, o in enumerate(offers):
        if isinstance(o, str):
            return f"rank {ranks[r]}: {o}"
    scope = ptrace_scope()
    for r, o in enumerate(offers):
        if r == me or isinstance(o, str):
            continue
        got = ctypes.create_string_buffer(_TOKEN)
        try:
            read(o.pid, ctypes.addressof(got), o.address, _TOKEN)
        except CmaError as exc:
            hint = ""
            if exc.errno == errno.EPERM:
                hint = (
                    f" (Yama ptrace_scope={scope})"
                    if scope
                    else " (another user, or a seccomp profile denies it)"
                )
            return f"rank {ranks[me]} cannot read rank {ranks[r]}: {exc.strerror}{hint}"
        if got.raw != o.token:
            return f"rank {ranks[me]} read a wrong token from rank {ranks[r]}"
    return ""


def note(on: bool, reason: str) -> None:
    """Record one group's decision for :func:`status`."""
    global _groups_on, _last_off
    with _lock:
        if on:
            _groups_on += 1
        else:
            _last_off = reason


def status() -> str:
    """Whether this process's groups read single-copy, in words (no peer is contacted)."""
    with _lock:
        on, off = _groups_on, _last_off
    if not enabled():
        return f"single-copy reads off ({ENV_CMA}=0)"
    parts = []
    if on:
        parts.append(f"single-copy reads (process_vm_readv) in {on} group(s)")
    if off:
        parts.append(f"slots only in a group because {off}")
    return "; ".join(parts) or "single-copy reads (process_vm_readv) probed at a group's setup"
