"""Optimizer state on NVMe (``offload_optimizer.device = "nvme"``), stages 1-3.

[Note: NVMe optimizer swap]
A sibling of :class:`~ds_core.zero.offload.host.OptimizerOffload` (see [Note: offload data path]):
the gradient side is unchanged (each unit's host ``grad`` range, accumulated as there), only
the fp32 master and the two Adam moments leave host memory. Each unit's range is cut into
sub-groups of at most ``zero_optimization.sub_group_size`` elements; a sub-group's file,
``<nvme_path>/ds_core_swap/rank<R>.<pid>/sg<N>.swp``, holds three regions (master, exp_avg,
exp_avg_sq), each starting at a 4 KiB-aligned offset so ``O_DIRECT`` moves them whole.

The step, per sub-group, through ``buffer_count`` host buffers (each one sub-group's three
regions, pinned where the backend has it):

1. reads run ``buffer_count - 1`` sub-groups ahead of the update, each queued in the I/O
   engine behind the write still draining from its buffer (``AsyncIO``'s ``after``), so the
   step itself never waits for a write before it reuses a buffer;
2. the current sub-group is updated by ``DeepSpeedCPUAdam``'s kernel (the same kernel and
   scalars as the host-offload step, so the same bits), piece by piece per parameter with
   that parameter's group's hyperparameters, the gradient multiplier fused;
3. the updated master goes to the unit's device range (16-bit through a staging buffer the
   size of a sub-group, cast on the host, as host offload does), and
4. the buffer is written back asynchronously and the step returns without waiting: the
   writes drain during the next forward and backward.

The last ``buffer_count`` sub-groups of a step stay *resident*: their buffers hold their
current state, and the next step takes the sub-groups in the opposite order, so it starts
with them without reading them (it waits only for their write-backs to have landed, long
done by then). A step thus reads ``max(0, N - buffer_count)`` of its ``N`` sub-groups and
keeps ``min(N, buffer_count)`` of them off its critical path; the order of sub-groups
changes no bits (Adam is element-wise). Everything else that touches the files or buffers
(checkpoint save and load, :meth:`read_state`, teardown) first waits for every write-back
and forgets the resident ones (:meth:`_drain`); a failed write-back is raised there or by
the next step, naming the file.

The optimizer's parameters (``zp.master``) are storage-less (``meta``) placeholders that
carry the parameter groups (learning rate, betas, weight decay, as schedulers change them);
``optimizer.state`` stays empty and the step count is kept here. The swap folder is created
(and checked writable) at engine start, every file is written then, and the folder is removed
at ``destroy()``. Checkpoints reach the state through :meth:`sub_group_pieces`,
:meth:`read_piece` and :meth:`write_piece` (see [Note: NVMe state in checkpoints] in
:mod:`ds_core.checkpoint._nvme`), which use the first buffer outside a step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from ds_core.accelerator import Accelerator
from ds_core.errors import ConfigError
from ds_core.io import ALIGN, AsyncIO, AsyncIOError
from ds_core.io.folders import make_swap_folder, remove_swap_folder
from ds_core.ops.cpu_adam import DeepSpeedCPUAdam
from ds_core.zero.config.offload import AioConfig, OffloadOptimizerConfig
from ds_core.zero.offload.host import OptimizerOffload, _HostRange
from ds_core.zero.partition import FlatUnit, ZeroParam

log = logging.getLogger("ds_core.zero")

__all__ = ["STATE", "NvmeOptimizerOffload"]

#: the regions of a sub-group's file, in order, under their checkpoint names.
STATE = ("fp32", "exp_avg", "exp_avg_sq")
_REGIONS = len(STATE)

StateViews = dict[str, torch.Tensor]


class _SubGroup:
    __slots__ = ("hr", "n", "path", "start")

    def __init__(self, hr: _HostRange, start: int, n: int, path: str) -> None:
        self.hr, self.start, self.n, self.path = hr, start, n, path


class NvmeOptimizerOffload(OptimizerOffload):
    """Masters and Adam moments in swap files (see [Note: NVMe optimizer swap]).

    :param acc: the accelerator. :param cfg: ``offload_optimizer`` (``device: nvme``).
    :param aio: the ``aio`` section. :param sub_group_size: elements per sub-group.
    :param rank: this process's global rank (names its swap folder).
    :raises ConfigError: when the swap folder cannot be created or written (at engine
        start; :meth:`make_masters` also when its file system lacks room for the files).
    """

    in_files = True

    def __init__(
        self,
        acc: Accelerator,
        cfg: OffloadOptimizerConfig,
        aio: AioConfig,
        sub_group_size: int,
        rank: int,
    ) -> None:
        super().__init__(acc, cfg.pin_memory)
        assert cfg.nvme_path is not None
        self.buffer_count = int(cfg.buffer_count)
        self.sub_group_size = int(sub_group_size)
        self.folder = make_swap_folder(
            cfg.nvme_path, f"rank{rank}.{os.getpid()}", "offload_optimizer.nvme_path"
        )
        self.io = AsyncIO(
            block_size=aio.block_size,
            queue_depth=aio.queue_depth,
            intra_op_parallelism=aio.intra_op_parallelism,
            thread_count=2,  # one sub-group's read and the previous one's write at once
        )
        log.info(
            "offload_optimizer: NVMe swap in %s (%s I/O, O_DIRECT %s), sub_group_size %d, "
            "%d buffers",
            self.folder,
            self.io.implementation,
            "on" if self.io._direct(os.path.join(self.folder, "x")) else "off",
            self.sub_group_size,
            self.buffer_count,
        )
        self.sub_groups: list[_SubGroup] = []
        self._buffers: list[torch.Tensor] = []
        self._stride = 0  # bytes between regions in a file, 4 KiB-aligned
        self._sg_max = 0
        self.step_count = 0
        self._held: _SubGroup | None = None  # the sub-group in buffer 0 outside a step
        self._dirty = False
        #: sub-group index -> buffer holding its current state (the last step's last ones).
        self._resident: dict[int, int] = {}
        self._buf_writes: list[list[Future[None]]] = []  # per buffer: its last write-back
        self._sg_writes: dict[int, list[Future[None]]] = {}  # per sub-group: its last write
        self._forward = False  # the last step's order (it alternates)
        #: seconds the steps waited, summed: for a swap-in (``swap_in_s``) and for a resident
        #: buffer's write-back (``swap_out_s``); benchmarks read and reset them.
        self.io_waits = {"swap_in_s": 0.0, "swap_out_s": 0.0}

    # -- construction ----------------------------------------------------------------------------

    def make_masters(self, units: Iterable[FlatUnit]) -> None:
        """Cut each unit's range into sub-groups, write their initial masters (the unit's
        current values in fp32) and zero moments to the files, and give every trainable
        parameter a storage-less master carrying its shape for the optimizer."""
        units = list(units)
        sizes = [u.part for u in units if u.part > 0]
        self._sg_max = min(self.sub_group_size, max(sizes, default=1))
        self._stride = -(-self._sg_max * 4 // ALIGN) * ALIGN
        for _ in range(min(self.buffer_count, 1 + sum(-(-s // self._sg_max) for s in sizes))):
            self._buffers.append(self._host(_REGIONS * self._stride // 4, torch.float32))
        self._buf_writes = [[] for _ in self._buffers]
        with torch.no_grad():
            for unit in units:
                grad = self._host(unit.part, torch.float32)
                hr = _HostRange(unit, torch.empty(unit.part, device="meta"), grad)
                self.ranges.append(hr)
                self._of[id(unit)] = hr
                for zp in unit.trainable:
                    piece = slice(zp.shard_offset, zp.shard_offset + zp.shard_numel)
                    zp.master = nn.Parameter(hr.master[piece])
                for start in range(0, unit.part, self._sg_max):
                    n = min(self._sg_max, unit.part - start)
                    path = os.path.join(self.folder, f"sg{len(self.sub_groups)}.swp")
                    self.sub_groups.append(_SubGroup(hr, start, n, path))
                if unit.dtype != torch.float32 and not unit.host_shard:
                    staging = self._staging.get(unit.dtype)
                    if staging is None:
                        self._staging[unit.dtype] = self._host(self._sg_max, unit.dtype)
            # Initial contents, through the buffers: the master from the unit, zero moments.
            try:
                self._check_space()
                for i, sg in enumerate(self.sub_groups):
                    buf = self._buffers[i % len(self._buffers)]
                    self.io.wait()  # the buffer's previous write has landed
                    buf.zero_()
                    buf[: sg.n].copy_(sg.hr.unit.owned()[sg.start : sg.start + sg.n])
                    self._write(sg, buf)
                self.io.wait()
            except AsyncIOError as exc:
                self.release()  # no swap folder left behind by a failed start
                raise ConfigError(
                    f"offload_optimizer.nvme_path: writing the initial swap files in "
                    f"{self.folder} failed: {exc}; free space there or choose another folder"
                ) from exc
            except ConfigError:
                self.release()
                raise

    def _check_space(self) -> None:
        """Refuse to start when the swap folder's file system cannot hold every file."""
        need = sum(_REGIONS * self._stride for _ in self.sub_groups)
        fs = os.statvfs(self.folder)
        free = fs.f_bavail * fs.f_frsize
        if need > free:
            raise ConfigError(
                f"offload_optimizer.nvme_path: the swap files need {need / 2**20:.1f} MiB but "
                f"{self.folder} has {free / 2**20:.1f} MiB free; free space there or choose "
                "another folder"
            )

    def _regions(self, sg: _SubGroup, buf: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        words = self._stride // 4
        return [(buf[k * words : k * words + sg.n], k * self._stride) for k in range(_REGIONS)]

    def _write(self, sg: _SubGroup, buf: torch.Tensor) -> list[Future[None]]:
        return [self.io.submit_write(t, sg.path, off) for t, off in self._regions(sg, buf)]

    def _read(
        self, sg: _SubGroup, buf: torch.Tensor, after: list[Future[None]] | None = None
    ) -> list[Future[None]]:
        return [
            self.io.submit_read(t, sg.path, off, after or ()) for t, off in self._regions(sg, buf)
        ]

    # -- the step ----------------------------------------------------------------------------

    def gradients_to_host(
        self,
        reduced: Iterable[tuple[FlatUnit, torch.Tensor]],
        mult: float | torch.Tensor,
        verdict: Callable[[], None] | None = None,
    ) -> float:
        """As host offload, without pointing ``.grad`` at the ranges (the masters are
        placeholders; the step reads the ranges itself)."""
        self._land(reduced, mult, verdict)
        return self._mult_value

    def uses_fused_scale(self, optimizer: Any) -> bool:
        return True

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float | None) -> None:
        """Swap in, update, publish and swap out every sub-group, reads ``buffer_count - 1``
        sub-groups ahead and write-backs left draining (see [Note: NVMe optimizer swap])."""
        if not isinstance(optimizer, DeepSpeedCPUAdam):
            raise ConfigError(
                f"offload_optimizer.device='nvme' steps with DeepSpeedCPUAdam; got "
                f"{type(optimizer).__name__}. Configure the optimizer in the config "
                "(optimizer.type Adam/AdamW) or pass a DeepSpeedCPUAdam"
            )
        self.settle()
        self._raise_failed_writes()
        scale = 1.0 if grad_scale is None else float(grad_scale)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.step_count += 1
        nbuf, count = len(self._buffers), len(self.sub_groups)
        # Resident sub-groups (the previous step's last ones, still in their buffers) go
        # first: the order alternates, so they need no read.
        self._forward = not self._forward
        order = list(range(count)) if self._forward else list(range(count - 1, -1, -1))
        order.sort(key=lambda i: i not in self._resident)  # stable: resident ones first
        free = [b for b in range(nbuf) if b not in self._resident.values()]
        slot: list[int] = []  # buffer of each position in ``order``
        for pos, i in enumerate(order):
            if i in self._resident:
                slot.append(self._resident[i])
            elif free:
                slot.append(free.pop(0))
            else:
                slot.append(slot[pos - nbuf])  # the buffer released longest ago
        reads: dict[int, list[Future[None]]] = {}
        ahead = 0  # positions whose read is submitted (or that need none)
        for pos, i in enumerate(order):
            sg, b = self.sub_groups[i], slot[pos]
            # Reads up to nbuf - 1 positions ahead, each queued behind the write still
            # draining from its buffer and the sub-group's own last write.
            while ahead < min(count, pos + nbuf):
                j = order[ahead]
                if j not in self._resident:
                    after = self._buf_writes[slot[ahead]] + self._sg_writes.get(j, [])
                    reads[ahead] = self._read(self.sub_groups[j], self._buffers[slot[ahead]],
                                              after)  # fmt: skip
                ahead += 1
            t0 = time.perf_counter()
            if pos in reads:
                for f in reads.pop(pos):
                    f.result()
                self.io_waits["swap_in_s"] += time.perf_counter() - t0
            else:  # resident: its last write-back must have read the buffer before it changes
                for f in self._buf_writes[b]:
                    f.result()
                self.io_waits["swap_out_s"] += time.perf_counter() - t0
            buf = self._buffers[b]
            self._update(sg, buf, optimizer, group_of, scale)
            self._publish(sg, buf)
            self._buf_writes[b] = self._sg_writes[i] = self._write(sg, buf)
        # Written back without waiting: the last ``nbuf`` stay resident for the next step;
        # a checkpoint, a load or teardown waits for the writes (:meth:`_drain`).
        self._resident = {order[pos]: slot[pos] for pos in range(max(0, count - nbuf), count)}

    def _raise_failed_writes(self) -> None:
        """Raise the first write-back of the previous step that already failed (naming its file,
        bytes and errno), before anything reads what it should have written: otherwise a read
        queued behind it would fail as cancelled, naming it only second-hand."""
        for futures in self._sg_writes.values():
            for f in futures:
                if f.done() and f.exception() is not None:
                    self._drain_quietly()
                    raise f.exception()  # type: ignore[misc]

    def _drain_quietly(self) -> None:
        """Forget every pending write-back after one failed (the step is abandoned)."""
        try:
            self._drain()
        except Exception:
            pass  # the first failure is the one raised

    def _drain(self) -> None:
        """Wait for every write-back (raising the first failure, naming the file) and forget
        the resident sub-groups: the caller reuses the buffers."""
        self._resident.clear()
        self._buf_writes = [[] for _ in self._buffers]
        self._sg_writes.clear()
        self.io.wait()

    def _update(
        self,
        sg: _SubGroup,
        buf: torch.Tensor,
        optimizer: DeepSpeedCPUAdam,
        group_of: dict[int, dict[str, Any]],
        scale: float,
    ) -> None:
        (master, _), (m, _), (v, _) = self._regions(sg, buf)
        lo, hi = sg.start, sg.start + sg.n
        for zp in sg.hr.unit.trainable:
            a = max(lo, zp.shard_offset)
            b = min(hi, zp.shard_offset + zp.shard_numel)
            if a >= b or zp.master is None:
                continue
            group = group_of[id(zp.master)]
            optimizer.kernel.step(
                master[a - lo : b - lo],
                sg.hr.grad[a:b],
                m[a - lo : b - lo],
                v[a - lo : b - lo],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=self.step_count,
                bias_correction=group["bias_correction"],
                adamw_mode=optimizer.adamw_mode,
                grad_scale=scale,
            )

    def _publish(self, sg: _SubGroup, buf: torch.Tensor) -> None:
        master = buf[: sg.n]
        unit = sg.hr.unit
        dst = unit.owned()[sg.start : sg.start + sg.n]
        with torch.no_grad():
            if unit.dtype == torch.float32 or unit.host_shard:
                dst.copy_(master)  # synchronous: the buffer is reused for the next sub-group
                return
            staging = self._staging[unit.dtype][: sg.n]
            staging.copy_(master)
            dst.copy_(staging)

    def publish(self) -> None:
        """Nothing left: each sub-group was published right after its update."""

    # -- checkpoint access (see [Note: NVMe state in checkpoints]) -----------------------------

    def _hold(self, sg: _SubGroup) -> torch.Tensor:
        """Swap ``sg`` into the first buffer (writing back the sub-group held before it when
        it was changed) and return the buffer."""
        if self._held is not sg:
            self.settle()
            self._drain()
            self._read(sg, self._buffers[0])
            self.io.wait()
            self._held = sg
        return self._buffers[0]

    def settle(self) -> None:
        """Write the held sub-group back when changed, wait for it, and forget it (the step
        reuses the buffer)."""
        if self._held is not None and self._dirty:
            self._write(self._held, self._buffers[0])
            self.io.wait()
        self._held, self._dirty = None, False

    def _overlaps(self, zp: ZeroParam) -> Iterator[tuple[_SubGroup, int, int]]:
        """The sub-groups holding ``zp``'s piece, with the overlap ``[a, b)`` in unit-range
        elements."""
        hr = self._of.get(id(zp.unit))
        if hr is None:
            raise AssertionError(f"{zp.name}: its unit is not NVMe-resident")
        lo, hi = zp.shard_offset, zp.shard_offset + zp.shard_numel
        for sg in self.sub_groups:
            if sg.hr is hr and sg.start < hi and lo < sg.start + sg.n:
                yield sg, max(lo, sg.start), min(hi, sg.start + sg.n)

    def sub_group_pieces(self) -> Iterator[tuple[int, list[tuple[ZeroParam, int, StateViews]]]]:
        """Each sub-group in turn, swapped in: ``(index, [(zparam, start within its piece,
        views)])`` where the views (``fp32`` and the moments, fp32 each) alias the swap
        buffer and are valid until the next item."""
        for i, sg in enumerate(self.sub_groups):
            buf = self._hold(sg)
            regions = [t for t, _ in self._regions(sg, buf)]
            pieces: list[tuple[ZeroParam, int, StateViews]] = []
            for zp in sg.hr.unit.trainable:
                a = max(sg.start, zp.shard_offset)
                b = min(sg.start + sg.n, zp.shard_offset + zp.shard_numel)
                if a < b and zp.master is not None:
                    views = {
                        k: r[a - sg.start : b - sg.start]
                        for k, r in zip(STATE, regions, strict=True)
                    }
                    pieces.append((zp, a - zp.shard_offset, views))
            yield i, pieces
        self.settle()

    def read_piece(self, zp: ZeroParam) -> StateViews:
        """``zp``'s piece of the master and moments, swapped in, as new flat host tensors."""
        out = {k: torch.empty(zp.shard_numel) for k in STATE}
        for sg, a, b in self._overlaps(zp):
            buf = self._hold(sg)
            for k, (region, _) in zip(STATE, self._regions(sg, buf), strict=True):
                out[k][a - zp.shard_offset : b - zp.shard_offset].copy_(
                    region[a - sg.start : b - sg.start]
                )
        return out

    def write_piece(self, zp: ZeroParam, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite ``zp``'s piece of the entries of :data:`STATE` given in ``values``
        (flat, the piece's length) in the swap files; :meth:`finish_load` completes it."""
        for sg, a, b in self._overlaps(zp):
            buf = self._hold(sg)
            for k, (region, _) in zip(STATE, self._regions(sg, buf), strict=True):
                if k in values:
                    src = values[k].reshape(-1)[a - zp.shard_offset : b - zp.shard_offset]
                    region[a - sg.start : b - sg.start].copy_(src)
                    self._dirty = True

    def finish_load(self, step: int | None) -> None:
        """After :meth:`write_piece` calls: land the last writes, set the step count (kept
        when ``None``), and publish every sub-group's master to its unit."""
        self.settle()
        if step is not None:
            self.step_count = int(step)
        for sg in self.sub_groups:
            self._publish(sg, self._hold(sg))
        self.settle()

    def read_state(self, unit: FlatUnit) -> dict[str, torch.Tensor]:
        """``unit``'s master and moments, read from the files into new host tensors."""
        self._drain()
        hr = self._of[id(unit)]
        out = {k: torch.empty(unit.part) for k in ("master", "exp_avg", "exp_avg_sq")}
        for sg in self.sub_groups:
            if sg.hr is not hr:
                continue
            for k, t in enumerate(out.values()):
                self.io.submit_read(t[sg.start : sg.start + sg.n], sg.path, k * self._stride)
        self.io.wait()
        return out

    # -- accounting and teardown -----------------------------------------------------------------

    def host_bytes(self) -> dict[str, int]:
        """``master``: the swap buffers (masters and moments of at most ``buffer_count``
        sub-groups); ``grads`` and ``staging`` as host offload."""
        grads = sum(hr.grad.numel() * 4 for hr in self.ranges)
        staging = sum(t.numel() * t.element_size() for t in self._staging.values())
        swap = sum(t.numel() * 4 for t in self._buffers)
        return {"master": swap, "grads": grads, "staging": staging}

    def release(self) -> None:
        """Finish I/O, close the handle, remove this rank's swap folder, drop the buffers."""
        try:
            self.io.close()
        finally:
            remove_swap_folder(self.folder)
            self.sub_groups.clear()
            self._buffers.clear()
            super().release()
