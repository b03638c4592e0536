"""The asynchronous file I/O handle (see :mod:`ds_core.io`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import Literal

import torch

from ds_core.errors import DSCoreError
from ds_core.ops._native import NativeLib
from ds_core.ops._signatures import Signatures

log = logging.getLogger("ds_core.io")

#: Chooses the implementation: ``auto`` | ``compiled`` | ``python``.
ENV_IMPL = "DS_CORE_ASYNC_IO"
Implementation = Literal["auto", "compiled", "python"]
#: O_DIRECT's alignment of file offsets, lengths and buffer addresses (the logical block
#: size of every NVMe and SATA disk in use; 512-byte disks accept it too).
ALIGN = 4096
_SOURCE = Path(__file__).parents[1] / "ops" / "csrc" / "async_io.c"
_CFLAGS = ("-std=c11", "-Wall", "-pthread")
_LDFLAGS = ("-pthread",)
_MAX_INTRA = 30  # AioConfig.intra_op_parallelism's bound
#: Most blocks of one request in flight (threads one transfer starts): queue_depth 8 x
#: intra_op_parallelism 4 fits; beyond it a virtio or NVMe queue gains nothing measurable.
MAX_BLOCKS_IN_FLIGHT = 32
#: The engine's one function, checked against ``ops/csrc/async_io.c`` when it is built.
SIGNATURES: Signatures = {
    "ds_aio_transfer": (
        "int",
        ("const char *", "int", "void *", "int64_t", "int64_t", "int64_t", "int", "int",
         "int64_t", "int64_t *"),
    ),
}  # fmt: skip


class AsyncIOError(DSCoreError, OSError):
    """A read or write that failed; the message names the operation and the file."""


# -- implementations: one transfer, start to end, on the calling thread --------------------


Transfer = Callable[[str, bool, int, int, int, int, int, bool], None]


def _fail(op: str, path: str, nbytes: int, offset: int, code: int, at: int) -> AsyncIOError:
    what = f"{op} of {nbytes} bytes at offset {offset} of '{path}'"
    if code == 1:
        with contextlib.suppress(OSError):
            at = os.stat(path).st_size  # where it ends, not where a chunk found out
        return AsyncIOError(
            errno.ENODATA,
            f"{what}: short read, the file ends at byte {at} (expected {offset + nbytes}); "
            "it is shorter than what was written to it",
        )
    e = -code
    where = "opening the file" if at < 0 else f"at file offset {at}"
    hint = {
        errno.ENOSPC: " (the disk is full)",
        errno.EFBIG: " (file size limit reached: the disk or RLIMIT_FSIZE is full)",
        errno.EACCES: " (permission denied: make the folder writable for this user)",
        errno.ENOENT: " (no such file or folder)",
        errno.EROFS: " (read-only file system)",
    }.get(e, "")
    return AsyncIOError(e, f"{what} failed {where}: {os.strerror(e)}{hint}")


class _Compiled:
    path = "compiled"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.ds_aio_transfer  # typed from SIGNATURES by build_shared_library

    def describe(self) -> str:
        return "compiled thread pool over pread/pwrite (ds_core.ops 'async_io')"

    def __call__(
        self,
        path: str,
        write: bool,
        addr: int,
        nbytes: int,
        offset: int,
        block: int,
        threads: int,
        direct: bool,
    ) -> None:
        at = ctypes.c_int64(-1)
        # ctypes releases the GIL for the call: transfers on several pool threads overlap.
        rc = self._fn(
            os.fsencode(path), int(write), addr, nbytes, offset, block, threads, int(direct),
            ALIGN, ctypes.byref(at),
        )  # fmt: skip
        if rc != 0:
            raise _fail("write" if write else "read", path, nbytes, offset, rc, at.value)


class _Python:
    """The same transfer with ``os.preadv`` / ``os.pwrite``: same chunks, same descriptors,
    same alignment rules, same errors (identical bytes, slower)."""

    path = "python"

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "pure-Python thread pool over os.preadv/os.pwrite"

    def _chunk_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    MAX_BLOCKS_IN_FLIGHT, thread_name_prefix="ds_aio_chunk"
                )
            return self._pool

    @staticmethod
    def _move(fd: int, fd_buf: int, write: bool, view: memoryview, off: int) -> int:
        """Move ``view``; returns 0, ``-errno`` or 1 (end of file), and where."""
        done, n = 0, len(view)
        while done < n:
            try:
                if write:
                    r = os.pwrite(fd, view[done:], off + done)
                else:
                    r = os.preadv(fd, [view[done:]], off + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise _StopError(-(exc.errno or errno.EIO), off + done) from None
            if r == 0:
                raise _StopError(-errno.EIO if write else 1, off + done)
            done += r
            fd = fd_buf
        return 0

    def _chunk(self, fds: tuple[int, int], write: bool, addr: int, length: int, off: int) -> None:
        fd_direct, fd_buf = fds
        view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
        if fd_direct >= 0 and off % ALIGN == 0 and length % ALIGN == 0:
            if addr % ALIGN == 0:
                self._move(fd_direct, fd_buf, write, view, off)
                return
            with mmap.mmap(-1, length) as bounce:  # page-aligned
                bview = memoryview(bounce)
                try:
                    if write:
                        bview[:] = view
                    self._move(fd_direct, fd_buf, write, bview, off)
                    if not write:
                        view[:] = bview
                finally:
                    bview.release()
            return
        self._move(fd_buf, fd_buf, write, view, off)

    def __call__(
        self,
        path: str,
        write: bool,
        addr: int,
        nbytes: int,
        offset: int,
        block: int,
        threads: int,
        direct: bool,
    ) -> None:
        op = "write" if write else "read"
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        flags |= os.O_CLOEXEC
        try:
            fd_buf = os.open(path, flags, 0o644)
        except OSError as exc:
            raise _fail(op, path, nbytes, offset, -(exc.errno or errno.EIO), -1) from None
        fd_direct = -1
        try:
            if direct:
                try:
                    fd_direct = os.open(path, flags | os.O_DIRECT, 0o644)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise _StopError(-(exc.errno or errno.EIO), -1) from None
            chunks = [
                (addr + s, min(block, nbytes - s), offset + s) for s in range(0, nbytes, block)
            ]
            fds = (fd_direct, fd_buf)
            # Like the C pool: `threads` workers take every threads-th chunk, so at most
            # `threads` blocks are in flight; a worker stops at its first failure.
            workers = max(1, min(threads, len(chunks)))

            def stripe(t: int) -> None:
                for a, n, o in chunks[t::workers]:
                    self._chunk(fds, write, a, n, o)

            futures = [self._chunk_pool().submit(stripe, t) for t in range(1, workers)]
            first: BaseException | None = None
            try:
                stripe(0)
            except BaseException as exc:  # raised once the other workers have finished
                first = exc
            for f in futures:  # every chunk finishes before the descriptors close
                failed = f.exception()
                if failed is not None and first is None:
                    first = failed
            if first is not None:
                raise first
        except _StopError as stop:
            raise _fail(op, path, nbytes, offset, stop.code, stop.at) from None
        finally:
            if fd_direct >= 0:
                os.close(fd_direct)
            os.close(fd_buf)


class _StopError(Exception):
    def __init__(self, code: int, at: int) -> None:
        super().__init__(code, at)
        self.code, self.at = code, at


_NATIVE: NativeLib[_Compiled | _Python] = NativeLib(
    "async_io",
    [_SOURCE],
    SIGNATURES,
    env=ENV_IMPL,
    compiled="compiled thread pool over pread/pwrite",
    python="pure-Python path",
    build_args=lambda: {"cflags": _CFLAGS, "ldflags": _LDFLAGS},
    log=log,
)


def load_impl(implementation: str | None = None) -> _Compiled | _Python:
    """The transfer implementation: compiled (built on first use through :mod:`ds_core.ops`)
    or pure Python; ``auto`` falls back to Python with one warning when no compiler builds it.

    :raises OpBuildError: with ``compiled`` when the library cannot be built.
    """
    return _NATIVE.load(implementation, _Compiled, _Python)


def io_status() -> str:
    """Which implementation is (or would be) active, for ``ds-core report``; builds nothing."""
    return _NATIVE.status()


# -- O_DIRECT probe ---------------------------------------------------------------------------

_DIRECT: dict[str, bool] = {}


def direct_supported(folder: str | os.PathLike[str]) -> bool:
    """Whether files in ``folder`` accept ``O_DIRECT`` (an aligned 4 KiB write and read
    through it; tmpfs and some overlay file systems refuse). Cached per folder."""
    key = os.path.realpath(folder)
    if key in _DIRECT:
        return _DIRECT[key]
    probe = os.path.join(key, f".ds_core_direct_probe.{os.getpid()}.{threading.get_ident()}")
    ok = False
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            with mmap.mmap(-1, ALIGN) as buf:
                ok = os.pwrite(fd, buf, 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
        except OSError:
            ok = False
        finally:
            os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    _DIRECT[key] = ok
    return ok


# -- the handle -------------------------------------------------------------------------------


class AsyncIO:
    """Reads and writes of host tensors to files at byte offsets, asynchronously.

    :param block_size: bytes per ``pread``/``pwrite`` call (rounded up to 4 KiB).
    :param queue_depth: blocks of a request kept in flight per intra-op thread (DeepSpeed's
        meaning: its libaio queue depth per thread).
    :param intra_op_parallelism: threads a request's blocks are spread over, each keeping
        ``queue_depth`` blocks in flight: a request has ``queue_depth x intra_op_parallelism``
        blocks in flight (at most :data:`MAX_BLOCKS_IN_FLIGHT`, and no more than it has
        blocks), each one blocking ``pread``/``pwrite`` on its own thread.
    :param thread_count: requests served at once (worker threads of the handle); further
        submits queue behind them without blocking the caller.
    :param use_direct: ``O_DIRECT`` (``None``: where :func:`direct_supported` says so).
    :param implementation: ``auto``, ``compiled`` or ``python`` (``None``: ``DS_CORE_ASYNC_IO``).

    Tensors must be contiguous and on the host, pinned or pageable, any dtype, any size or
    address (unaligned pieces go through aligned bounce buffers or a buffered descriptor).
    Every request opens its file and closes it before it completes, so no descriptor outlives
    a request, whether it succeeded or failed.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        intra_op_parallelism: int = 1,
        thread_count: int = 1,
        use_direct: bool | None = None,
        implementation: Implementation | None = None,
    ) -> None:
        if block_size <= 0 or queue_depth <= 0 or intra_op_parallelism <= 0 or thread_count <= 0:
            raise ValueError(
                "AsyncIO: block_size, queue_depth, intra_op_parallelism and thread_count must "
                "be positive"
            )
        self.block_size = -(-int(block_size) // ALIGN) * ALIGN
        self.queue_depth = int(queue_depth)
        self.intra = min(int(intra_op_parallelism), _MAX_INTRA)
        #: blocks of one request in flight at once (threads its transfer runs on).
        self.blocks_in_flight = min(self.queue_depth * self.intra, MAX_BLOCKS_IN_FLIGHT)
        self.use_direct = use_direct
        self.impl = load_impl(implementation)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max(1, int(thread_count)), thread_name_prefix="ds_aio"
        )
        self._pending: list[Future[None]] = []
        self._pruned = 0  # requests that finished cleanly and left ``_pending`` unwaited

    @property
    def implementation(self) -> str:
        return self.impl.path

    def _direct(self, path: str) -> bool:
        if self.use_direct is not None:
            return self.use_direct
        return direct_supported(os.path.dirname(os.path.abspath(path)) or ".")

    def _submit(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int,
                write: bool, after: Iterable[Future[None]]) -> Future[None]:  # fmt: skip
        if self._pool is None:
            raise AsyncIOError(errno.EBADF, "AsyncIO: the handle is closed")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"AsyncIO: tensors must be contiguous and on the host, got {tensor.device} "
                f"{'contiguous' if tensor.is_contiguous() else 'non-contiguous'}"
            )
        if offset < 0:
            raise ValueError(f"AsyncIO: offset {offset} < 0")
        p = os.fspath(path)
        nbytes = tensor.numel() * tensor.element_size()
        args = (p, write, tensor.data_ptr(), nbytes, int(offset), self.block_size,
                self.blocks_in_flight, self._direct(p))  # fmt: skip

        before = list(after)

        def run() -> None:
            try:
                # Futures submitted earlier to this FIFO pool: each has started, or will before
                # this one, so waiting for them here cannot deadlock.
                done, _ = wait_all(before)
                for f in done:
                    failed = f.exception()
                    if failed is not None:
                        raise AsyncIOError(
                            errno.ECANCELED,
                            f"{'write' if write else 'read'} of {nbytes} bytes at offset "
                            f"{offset} of '{p}' not started: a request it waits for failed "
                            f"({failed})",
                        ) from failed
                if nbytes:
                    self.impl(*args)
            finally:
                del hold[:]

        hold = [tensor]  # the tensor's memory stays alive until the transfer ends
        fut = self._pool.submit(run)
        # Finished requests that succeeded have nothing left to report: a handle written
        # back without waiting (NVMe offload) must not grow its list step after step.
        keep = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pruned += len(self._pending) - len(keep)
        self._pending = keep
        self._pending.append(fut)
        return fut

    def submit_read(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0,
                    after: Iterable[Future[None]] = ()) -> Future[None]:  # fmt: skip
        """Start reading ``tensor``'s bytes from ``path`` at ``offset``.

        :param after: requests of this handle that must finish first (a write still draining
            from ``tensor``'s memory or into the same file); the caller does not wait for
            them. When one of them failed, this request fails without running
            (:class:`AsyncIOError`, ``ECANCELED``, naming the failure).
        """
        return self._submit(tensor, path, offset, False, after)

    def submit_write(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0,
                     after: Iterable[Future[None]] = ()) -> Future[None]:  # fmt: skip
        """Start writing ``tensor``'s bytes into ``path`` at ``offset`` (created if absent);
        ``after`` as for :meth:`submit_read`."""
        return self._submit(tensor, path, offset, True, after)

    def wait(self) -> int:
        """Wait for every request submitted so far; returns how many completed.

        :raises AsyncIOError: the first failure (after every request has finished), naming
            the operation and the file.
        """
        pending, self._pending = self._pending, []
        pruned, self._pruned = self._pruned, 0
        first: BaseException | None = None
        for f in pending:
            exc = f.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first
        return len(pending) + pruned

    def _sync(self, fut: Future[None]) -> None:
        # Reported here, not again by the next wait() (pruned if it finished cleanly).
        if fut in self._pending:
            self._pending.remove(fut)
        else:
            self._pruned -= 1
        fut.result()

    def sync_read(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> None:
        """Read and wait for this one request."""
        self._sync(self.submit_read(tensor, path, offset))

    def sync_write(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> None:
        """Write and wait for this one request."""
        self._sync(self.submit_write(tensor, path, offset))

    def close(self) -> None:
        """Finish outstanding requests (their errors are dropped) and stop the workers."""
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(BaseException):
                self.wait()
            pool.shutdown(wait=True)

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
