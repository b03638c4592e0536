"""Asynchronous file I/O of host tensors (ZeRO-Infinity's swap path).

:class:`AsyncIO` submits reads and writes of contiguous host tensors (pinned or pageable,
any dtype) to files at byte offsets and waits for them. A request is split into
``block_size`` chunks of which ``queue_depth x intra_op_parallelism`` (at most 32) are in
flight at once, one blocking ``pread``/``pwrite`` per thread, so even one intra-op thread keeps
``queue_depth`` blocks outstanding as DeepSpeed's libaio engine does; ``thread_count``
requests run at once and later submits queue. ``O_DIRECT`` is used where the folder's
file system accepts it (:func:`direct_supported` probes it; tmpfs does not), chunks whose
address is not 4 KiB-aligned go through an aligned bounce buffer, and a tail whose size is
not aligned goes through a buffered descriptor: no I/O error and no short read from alignment.
A file shorter than what is read is an error (never a silent short read).

Two implementations give the same bytes: a C thread pool over ``pread``/``pwrite`` built
through :mod:`ds_core.ops` (no libaio or liburing needed) and a pure-Python one over
``os.preadv``/``os.pwrite``. ``DS_CORE_ASYNC_IO`` = ``auto`` (default) | ``compiled`` |
``python``; ``ds-core report`` says which is active (:func:`io_status`).

Errors (disk full, permission, missing path, a short file) raise :class:`AsyncIOError`
naming the operation, the file, the offset and the cause. Every request opens and closes its
own descriptors, on success and on error.
"""

from ds_core.io._engine import (
    ALIGN,
    ENV_IMPL,
    AsyncIO,
    AsyncIOError,
    direct_supported,
    io_status,
    load_impl,
)

__all__ = [
    "ALIGN",
    "ENV_IMPL",
    "AsyncIO",
    "AsyncIOError",
    "direct_supported",
    "io_status",
    "load_impl",
]
