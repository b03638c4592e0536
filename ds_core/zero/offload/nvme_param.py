"""Stage-3 parameter shards on NVMe (``offload_param.device = "nvme"``).

[Note: NVMe parameter swap]
Each PARTITIONED unit's shard (this rank's ``part`` elements, see [Note: shard layout]) lives
in one swap file, ``<nvme_path>/ds_core_swap/param_rank<R>.<pid>/unit<N>.swp``, preallocated
at engine start (so a full or unwritable folder fails before training, naming the file).
The first units of the module up to ``max_in_cpu`` elements stay in host memory as with
``device: cpu``; the rest are *swapped*: their ``FlatUnit.shard`` is a view of one of
``buffer_count`` host buffers (pinned where the backend has it) while the unit is resident,
``None`` otherwise, so a swapped-out shard holds no host memory.

- Reads: a gather takes the shard from its buffer (:meth:`ParamSwapper.fetch`, waiting for a
  read in flight). :class:`~ds_core.zero.stage3.ParamCoordinator` calls
  :meth:`ParamSwapper.prefetch` for the module after the one being prefetched in the recorded
  trace, so that read runs while the current module computes. A prefetch of a unit whose
  buffer already holds it (read in flight, or resident from earlier) reuses that buffer: no
  second read, no second buffer (DeepSpeed failed in exactly this case).
- Writes: whoever may modify the shard (``owned()``, ``write_owned``, ``place``) marks it
  dirty. :meth:`ParamSwapper.flush`, after the optimizer step publishes, submits each dirty
  shard's write without waiting; a buffer is reused only after its writes have landed (and,
  where the device copy of a gather read it asynchronously, after that copy's event).
- Eviction: least recently used first; a buffer whose read nobody consumed yet is not taken
  by a prefetch (a prefetch never undoes another), only by a unit that is needed now.

The folder is removed and the buffers handed back at :meth:`ParamSwapper.close`
(``engine.destroy()``); every request opens and closes its own descriptors (:mod:`ds_core.io`).
"""

from __future__ import annotations

import itertools
import logging
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from ds_core.accelerator import Accelerator
from ds_core.errors import ConfigError
from ds_core.io import ALIGN, AsyncIO
from ds_core.io.folders import make_swap_folder, remove_swap_folder
from ds_core.zero.config.offload import AioConfig, OffloadParamConfig

if TYPE_CHECKING:
    from ds_core.zero.partition import FlatUnit

log = logging.getLogger("ds_core.zero")

__all__ = ["ParamSwapper"]


class _Slot:
    """One host buffer of the pool and the unit it holds."""

    __slots__ = ("buf", "dirty", "h2d", "raw", "read", "tick", "unit", "writes")

    def __init__(self, raw: torch.Tensor, nbytes: int) -> None:
        self.raw = raw  # what was allocated (and is freed): ``nbytes`` + ALIGN bytes
        # O_DIRECT moves a buffer that starts on a 4 KiB boundary without a bounce copy;
        # torch's allocators align to 64 bytes (the optimizer's swapper does the same:
        # ds_core/zero/offload/nvme.py, ``_aligned``)
        skip = -raw.data_ptr() % ALIGN
        self.buf = raw[skip : skip + nbytes]  # uint8, the largest swapped shard's bytes
        self.unit: FlatUnit | None = None
        self.read: Future[None] | None = None  # a swap-in in flight
        self.writes: list[Future[None]] = []  # swap-outs in flight
        self.h2d: Any = None  # event of an asynchronous device copy reading the buffer
        self.dirty = False
        self.tick = 0


class ParamSwapper:
    """Owns the swap files and buffer pool of NVMe parameter offload (see
    [Note: NVMe parameter swap]).

    :param acc: the accelerator (pinned buffers, events).
    :param cfg: ``offload_param`` with ``device: nvme``.
    :param aio: the ``aio`` section.
    :param rank: this process's global rank (names its swap folder).
    :raises ConfigError: when the swap folder cannot be created or written.
    """

    def __init__(
        self, acc: Accelerator, cfg: OffloadParamConfig, aio: AioConfig, rank: int
    ) -> None:
        assert cfg.nvme_path is not None  # the config validator requires it
        self.acc = acc
        self.buffer_count = int(cfg.buffer_count)
        self.buffer_size = int(cfg.buffer_size)
        self.max_in_cpu = int(cfg.max_in_cpu)
        self.pinned = bool(cfg.pin_memory) and "pinned_memory" in acc.capabilities
        self.folder = make_swap_folder(
            cfg.nvme_path, f"param_rank{rank}.{os.getpid()}", "offload_param.nvme_path"
        )
        self.io = AsyncIO(
            block_size=aio.block_size,
            queue_depth=aio.queue_depth,
            intra_op_parallelism=aio.intra_op_parallelism,
            thread_count=2,  # a prefetch's read and a write-back at once
        )
        #: elements kept in host memory so far (``max_in_cpu``).
        self.in_cpu = 0
        self.paths: dict[int, str] = {}
        self._fresh: set[int] = set()  # preallocated files never written: read as zeros
        self._slot_of: dict[int, _Slot] = {}
        self.slots: list[_Slot] = []
        self._units: list[FlatUnit] = []
        self._clock = itertools.count(1)
        #: swap-ins issued; prefetches that found their unit already in a buffer (reused,
        #: no read); fetches that found it there (read ahead, or still resident).
        self.reads = 0
        self.reused = 0
        self.hits = 0
        self.closed = False

    # -- construction ----------------------------------------------------------------------------

    def adopt(self, unit: FlatUnit) -> bool:
        """Decide where ``unit``'s shard lives: ``False`` keeps it in host memory
        (``max_in_cpu`` not used up yet), ``True`` swaps it; its file is preallocated now.

        :raises ConfigError: the shard is larger than ``buffer_size``, or its file cannot be
            created at its full size (full disk, permission), naming the file.
        """
        if not self._units and self.in_cpu + unit.part <= self.max_in_cpu:
            self.in_cpu += unit.part  # a prefix of the module stays; after one swap, all do
            return False
        if unit.part > self.buffer_size:
            self.close()  # the engine is not built: leave no folder behind
            raise ConfigError(
                f"offload_param.buffer_size={self.buffer_size} elements is smaller than a "
                f"stage-3 shard of {unit.part} elements ({unit!r}); set buffer_size to at "
                f"least {unit.part}, or lower reduce_bucket_size (the most elements per unit)"
            )
        path = os.path.join(self.folder, f"unit{len(self._units)}.swp")
        nbytes = unit.part * unit.itemsize
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            self.close()
            raise ConfigError(
                f"offload_param.nvme_path: cannot create the swap file {path} of {nbytes} "
                f"bytes: {exc.strerror or exc}; free space there or choose another folder"
            ) from exc
        self.paths[id(unit)] = path
        self._fresh.add(id(unit))
        self._units.append(unit)
        return True

    def _pool(self) -> None:
        """The buffers, sized at first use to the largest swapped shard (at most
        ``buffer_size`` elements), ``buffer_count`` of them at most one per swapped unit."""
        nbytes = max(u.part * u.itemsize for u in self._units)
        for _ in range(min(self.buffer_count, len(self._units))):
            if self.pinned:
                raw = self.acc.alloc_pinned((nbytes + ALIGN,), torch.uint8)
            else:
                raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
            self.slots.append(_Slot(raw, nbytes))
        log.info(
            "offload_param: %d shards swapped in %s (%s I/O), %d elements kept in host "
            "memory (max_in_cpu), %d %s buffers of %d bytes",
            len(self._units),
            self.folder,
            self.io.implementation,
            self.in_cpu,
            len(self.slots),
            "pinned" if self.pinned else "pageable",
            nbytes,
        )

    # -- residency -------------------------------------------------------------------------------

    def _view(self, slot: _Slot, unit: FlatUnit) -> torch.Tensor:
        es = unit.itemsize
        return slot.buf[: unit.part * es].view(unit.dtype)

    def _drain(self, slot: _Slot) -> None:
        """Make ``slot`` free of I/O and device reads (before reuse)."""
        if slot.read is not None:
            slot.read.result()
            slot.read = None
        if slot.dirty and slot.unit is not None:
            self._write(slot)
        self._written(slot)
        if slot.h2d is not None:
            slot.h2d.synchronize()
            slot.h2d = None

    def _write(self, slot: _Slot) -> None:
        unit = slot.unit
        assert unit is not None
        unit.settle_host_write()  # a device -> host copy into the buffer has landed
        self._written(slot)  # two writes of one file in flight could land out of order
        slot.writes.append(self.io.submit_write(self._view(slot, unit), self.paths[id(unit)]))
        self._fresh.discard(id(unit))
        slot.dirty = False

    def _victim(self, for_prefetch: bool) -> _Slot | None:
        free = [s for s in self.slots if s.unit is None]
        if free:
            return free[0]
        busy = [s for s in self.slots if not (for_prefetch and s.read is not None)]
        return min(busy, key=lambda s: s.tick) if busy else None

    def _acquire(self, unit: FlatUnit, for_prefetch: bool) -> _Slot | None:
        if not self.slots:
            self._pool()
        slot = self._slot_of.get(id(unit))
        if slot is not None:
            if for_prefetch:
                self.reused += 1  # already allocated and holding this shard: reuse it
            else:
                self.hits += 1
            slot.tick = next(self._clock)
            return slot
        slot = self._victim(for_prefetch)
        if slot is None:
            return None
        self._drain(slot)
        if slot.unit is not None:  # evict: its data is in its file now
            del self._slot_of[id(slot.unit)]
            slot.unit.shard = None
        slot.unit, slot.tick = unit, next(self._clock)
        self._slot_of[id(unit)] = slot
        view = self._view(slot, unit)
        if id(unit) in self._fresh:
            view.zero_()  # what the preallocated file holds
        else:
            slot.read = self.io.submit_read(view, self.paths[id(unit)])
            self.reads += 1
        unit.shard = view
        return slot

    def prefetch(self, unit: FlatUnit) -> None:
        """Start swapping ``unit``'s shard in (no wait); reuses the buffer already holding it.
        Skipped when every buffer holds a prefetched shard nobody has used yet."""
        self._acquire(unit, for_prefetch=True)

    def fetch(self, unit: FlatUnit, dirty: bool = False) -> torch.Tensor:
        """``unit``'s shard in a buffer, its read finished; ``dirty``: the caller may modify it
        (written back at the next :meth:`flush` or before its buffer is reused)."""
        slot = self._acquire(unit, for_prefetch=False)
        assert slot is not None
        if slot.read is not None:
            slot.read.result()  # raises AsyncIOError naming the file
            slot.read = None
        if dirty:
            self._written(slot)  # the caller is about to change what a write may be reading
            slot.dirty = True
        return self._view(slot, unit)

    @staticmethod
    def _written(slot: _Slot) -> None:
        for f in slot.writes:
            f.result()  # raises AsyncIOError naming the file
        slot.writes = []

    def read_by_device(self, unit: FlatUnit) -> None:
        """A device copy reads ``unit``'s buffer asynchronously: its buffer is reused only
        after the event recorded now."""
        slot = self._slot_of.get(id(unit))
        if slot is not None and self.pinned:
            slot.h2d = self.acc.Event()
            slot.h2d.record()

    def flush(self) -> None:
        """Submit the write-back of every modified shard (after the step); no wait."""
        for slot in self.slots:
            if slot.dirty and slot.unit is not None:
                self._write(slot)

    def resident(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s shard is in a buffer now."""
        return id(unit) in self._slot_of

    def forget(self, unit: FlatUnit) -> None:
        """Teardown of one unit: its buffer (if any) is free, without writing it back."""
        slot = self._slot_of.pop(id(unit), None)
        if slot is not None:
            slot.dirty = False
            self._drain(slot)
            slot.unit = None
        unit.shard = None

    # -- accounting and teardown -----------------------------------------------------------------

    def pool_bytes(self) -> int:
        """Host bytes of the buffer pool (the only host memory swapped shards use), the
        alignment slack included."""
        return sum(s.raw.numel() for s in self.slots)

    def close(self) -> None:
        """Finish I/O, close the handle, hand the buffers back and remove the swap folder."""
        if self.closed:
            return
        self.closed = True
        try:
            for slot in self.slots:
                slot.dirty = False
                if slot.h2d is not None:
                    slot.h2d.synchronize()
            self.io.close()
        finally:
            for unit in self._units:
                if id(unit) in self._slot_of:
                    unit.shard = None
            if self.pinned:
                for slot in self.slots:
                    self.acc.free_pinned(slot.raw)
            self.slots.clear()
            self._slot_of.clear()
            self._units.clear()
            remove_swap_folder(self.folder)
