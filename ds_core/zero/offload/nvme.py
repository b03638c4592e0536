"""Optimizer state on NVMe (``offload_optimizer.device = "nvme"``), stages 1-3.

[Note: NVMe optimizer swap]
A sibling of :class:`~ds_core.zero.offload.host.OptimizerOffload` (see [Note: offload data path]):
the gradient side is unchanged (each unit's host ``grad`` range, accumulated as there), only
the fp32 master and the two Adam moments leave host memory. The units' ranges, in order, are
packed into sub-groups of ``min(zero_optimization.sub_group_size, the largest unit's range)``
elements (the last one shorter): a unit larger than that is cut, smaller ones share a
sub-group, so host memory is what one sub-group per unit took and a step reads few large
sub-groups rather than many small ones (52 -> 25 for the ``large`` GPT at stage 3, whose
layer norms are units of 768 elements). DeepSpeed packs parameters the same way, to at least
``sub_group_size`` (``_create_fp16_sub_groups`` in deepspeed/runtime/zero/stage3.py), which at
its default of 1e9 makes one sub-group, and buffers, of the whole state. A sub-group's file,
``<nvme_path>/ds_core_swap/rank<R>.<pid>/sg<N>.swp``, holds three regions (master, exp_avg,
exp_avg_sq) at multiples of its length rounded up to 4 KiB, where its buffer holds them, so
one ``O_DIRECT`` request moves all three.

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


class _Piece:
    """Unit-range elements ``[start, start + n)`` of ``hr``, at element ``at`` of a sub-group."""

    __slots__ = ("at", "hr", "n", "start")

    def __init__(self, hr: _HostRange, start: int, n: int, at: int) -> None:
        self.hr, self.start, self.n, self.at = hr, start, n, at


class _SubGroup:
    """``n`` elements in ``pieces`` (of one or more units); ``stride``: bytes between its
    regions, in its file and in the buffer holding it (``4 n`` rounded up to 4 KiB)."""

    __slots__ = ("n", "path", "pieces", "stride")

    def __init__(self, path: str) -> None:
        self.path, self.n, self.stride = path, 0, 0
        self.pieces: list[_Piece] = []

    def add(self, hr: _HostRange, start: int, n: int) -> None:
        self.pieces.append(_Piece(hr, start, n, self.n))
        self.n += n
        self.stride = -(-self.n * 4 // ALIGN) * ALIGN


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
        self._sg_max = 0  # elements a buffer holds (a sub-group's most)
        self.step_count = 0
        self._held: _SubGroup | None = None  # the sub-group in buffer 0 outside a step
        self._dirty = False
        #: sub-group index -> buffer holding its current state (the last step's last ones).
        self._resident: dict[int, int] = {}
        self._buf_writes: list[list[Future[None]]] = []  # per buffer: its last write-back
        self._sg_writes: dict[int, list[Future[None]]] = {}  # per sub-group: its last write
        self._forward = False  # the last step's order (it alternates)
        #: seconds the steps spent, summed (benchmarks read and reset them): waiting for a
        #: swap-in (``swap_in_s``) or a resident buffer's write-back (``swap_out_s``), in the
        #: Adam kernel (``update_s``), copying masters to the units (``publish_s``) and
        #: submitting write-backs (``write_s``).
        self.step_seconds = dict.fromkeys(
            ("swap_in_s", "swap_out_s", "update_s", "publish_s", "write_s"), 0.0
        )

    # -- construction ----------------------------------------------------------------------------

    def make_masters(self, units: Iterable[FlatUnit]) -> None:
        """Cut each unit's range into sub-groups, write their initial masters (the unit's
        current values in fp32) and zero moments to the files, and give every trainable
        parameter a storage-less master carrying its shape for the optimizer."""
        units = list(units)
        cap = max(1, min(self.sub_group_size, max((u.part for u in units), default=1)))
        self._sg_max = cap
        sg: _SubGroup | None = None
        with torch.no_grad():
            for unit in units:
                grad = self._host(unit.part, torch.float32)
                hr = _HostRange(unit, torch.empty(unit.part, device="meta"), grad)
                self.ranges.append(hr)
                self._of[id(unit)] = hr
                for zp in unit.trainable:
                    piece = slice(zp.shard_offset, zp.shard_offset + zp.shard_numel)
                    zp.master = nn.Parameter(hr.master[piece])
                # Units are packed, in order, into sub-groups filled to the buffer's size: a
                # unit smaller than a buffer (stage 3's per-layer units) shares one sub-group
                # with its neighbours, so a step reads few large sub-groups, not many small.
                start = 0
                while start < unit.part:
                    if sg is None or sg.n == cap:
                        sg = _SubGroup(os.path.join(self.folder, f"sg{len(self.sub_groups)}.swp"))
                        self.sub_groups.append(sg)
                    n = min(cap - sg.n, unit.part - start)
                    sg.add(hr, start, n)
                    start += n
                if unit.dtype != torch.float32 and not unit.host_shard:
                    staging = self._staging.get(unit.dtype)
                    if staging is None:
                        self._staging[unit.dtype] = self._host(cap, unit.dtype)
            region = -(-cap * 4 // ALIGN) * ALIGN // 4
            for _ in range(min(self.buffer_count, 1 + len(self.sub_groups))):
                self._buffers.append(self._aligned(_REGIONS * region))
            self._buf_writes = [[] for _ in self._buffers]
            # Initial contents, through the buffers: the master from the unit, zero moments.
            try:
                self._check_space()
                for i, sg in enumerate(self.sub_groups):
                    buf = self._buffers[i % len(self._buffers)]
                    self.io.wait()  # the buffer's previous write has landed
                    buf.zero_()
                    for p in sg.pieces:
                        buf[p.at : p.at + p.n].copy_(p.hr.unit.owned()[p.start : p.start + p.n])
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

    def _aligned(self, numel: int) -> torch.Tensor:
        """A zeroed fp32 host buffer of ``numel`` elements starting on a 4 KiB boundary (and
        ``ALIGN`` bytes more held): ``O_DIRECT`` moves it without a bounce copy. torch's
        allocator aligns to 64 bytes only, and bounced 1 MiB blocks cost 3-4x the CPU per GiB
        and 2-5x the time under load (bench/README.md, "NVMe step: where the time goes")."""
        raw = self._host(numel + ALIGN // 4, torch.float32)
        skip = (-raw.data_ptr() % ALIGN) // 4
        return raw[skip : skip + numel]

    def _check_space(self) -> None:
        """Refuse to start when the swap folder's file system cannot hold every file."""
        need = sum(_REGIONS * sg.stride for sg in self.sub_groups)
        fs = os.statvfs(self.folder)
        free = fs.f_bavail * fs.f_frsize
        if need > free:
            raise ConfigError(
                f"offload_optimizer.nvme_path: the swap files need {need / 2**20:.1f} MiB but "
                f"{self.folder} has {free / 2**20:.1f} MiB free; free space there or choose "
                "another folder"
            )

    def _regions(self, sg: _SubGroup, buf: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        words = sg.stride // 4
        return [(buf[k * words : k * words + sg.n], k * sg.stride) for k in range(_REGIONS)]

    # The buffer holds the regions where the file does, so one request moves all three (the
    # padding between them included): one file open and one O_DIRECT stream per sub-group.
    def _write(self, sg: _SubGroup, buf: torch.Tensor) -> list[Future[None]]:
        return [self.io.submit_write(buf[: _REGIONS * sg.stride // 4], sg.path, 0)]

    def _read(
        self, sg: _SubGroup, buf: torch.Tensor, after: list[Future[None]] | None = None
    ) -> list[Future[None]]:
        return [self.io.submit_read(buf[: _REGIONS * sg.stride // 4], sg.path, 0, after or ())]

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
                wait = "swap_in_s"
            else:  # resident: its last write-back must have read the buffer before it changes
                for f in self._buf_writes[b]:
                    f.result()
                wait = "swap_out_s"
            buf = self._buffers[b]
            t1 = time.perf_counter()
            self._update(sg, buf, optimizer, group_of, scale)
            t2 = time.perf_counter()
            self._publish(sg, buf)
            t3 = time.perf_counter()
            self._buf_writes[b] = self._sg_writes[i] = self._write(sg, buf)
            t4 = time.perf_counter()
            secs = self.step_seconds
            secs[wait] += t1 - t0
            secs["update_s"] += t2 - t1
            secs["publish_s"] += t3 - t2
            secs["write_s"] += t4 - t3
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
        for p, zp, a, b in self._params(sg):
            group = group_of[id(zp.master)]
            at = slice(p.at + a - p.start, p.at + b - p.start)
            optimizer.kernel.step(
                master[at],
                p.hr.grad[a:b],
                m[at],
                v[at],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=self.step_count,
                bias_correction=group["bias_correction"],
                adamw_mode=optimizer.adamw_mode,
                grad_scale=scale,
            )

    @staticmethod
    def _params(sg: _SubGroup) -> Iterator[tuple[_Piece, ZeroParam, int, int]]:
        """Each trainable parameter's part of each piece of ``sg``: ``(piece, zparam, a, b)``
        with ``[a, b)`` in unit-range elements."""
        for p in sg.pieces:
            for zp in p.hr.unit.trainable:
                a = max(p.start, zp.shard_offset)
                b = min(p.start + p.n, zp.shard_offset + zp.shard_numel)
                if a < b and zp.master is not None:
                    yield p, zp, a, b

    def _publish(self, sg: _SubGroup, buf: torch.Tensor) -> None:
        with torch.no_grad():
            for p in sg.pieces:
                master = buf[p.at : p.at + p.n]
                unit = p.hr.unit
                dst = unit.owned()[p.start : p.start + p.n]
                if unit.dtype == torch.float32 or unit.host_shard:
                    dst.copy_(master)  # synchronous: the buffer is reused for the next sub-group
                    continue
                staging = self._staging[unit.dtype][: p.n]
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

    def _overlaps(self, zp: ZeroParam) -> Iterator[tuple[_SubGroup, int, int, int]]:
        """The sub-groups holding ``zp``'s piece: ``(sub-group, at, a, b)``, the overlap
        ``[a, b)`` in unit-range elements starting at element ``at`` of the sub-group."""
        hr = self._of.get(id(zp.unit))
        if hr is None:
            raise AssertionError(f"{zp.name}: its unit is not NVMe-resident")
        lo, hi = zp.shard_offset, zp.shard_offset + zp.shard_numel
        for sg in self.sub_groups:
            for p in sg.pieces:
                if p.hr is hr and p.start < hi and lo < p.start + p.n:
                    a, b = max(lo, p.start), min(hi, p.start + p.n)
                    yield sg, p.at + a - p.start, a, b

    def sub_group_pieces(self) -> Iterator[tuple[int, list[tuple[ZeroParam, int, StateViews]]]]:
        """Each sub-group in turn, swapped in: ``(index, [(zparam, start within its piece,
        views)])`` where the views (``fp32`` and the moments, fp32 each) alias the swap
        buffer and are valid until the next item."""
        for i, sg in enumerate(self.sub_groups):
            buf = self._hold(sg)
            regions = [t for t, _ in self._regions(sg, buf)]
            pieces: list[tuple[ZeroParam, int, StateViews]] = []
            for p, zp, a, b in self._params(sg):
                at = slice(p.at + a - p.start, p.at + b - p.start)
                views = {k: r[at] for k, r in zip(STATE, regions, strict=True)}
                pieces.append((zp, a - zp.shard_offset, views))
            yield i, pieces
        self.settle()

    def read_piece(self, zp: ZeroParam) -> StateViews:
        """``zp``'s piece of the master and moments, swapped in, as new flat host tensors."""
        out = {k: torch.empty(zp.shard_numel) for k in STATE}
        for sg, at, a, b in self._overlaps(zp):
            buf = self._hold(sg)
            for k, (region, _) in zip(STATE, self._regions(sg, buf), strict=True):
                out[k][a - zp.shard_offset : b - zp.shard_offset].copy_(region[at : at + b - a])
        return out

    def write_piece(self, zp: ZeroParam, values: Mapping[str, torch.Tensor]) -> None:
        """Overwrite ``zp``'s piece of the entries of :data:`STATE` given in ``values``
        (flat, the piece's length) in the swap files; :meth:`finish_load` completes it."""
        for sg, at, a, b in self._overlaps(zp):
            buf = self._hold(sg)
            for k, (region, _) in zip(STATE, self._regions(sg, buf), strict=True):
                if k in values:
                    src = values[k].reshape(-1)[a - zp.shard_offset : b - zp.shard_offset]
                    region[at : at + b - a].copy_(src)
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
        hr = self._of[id(unit)]
        out = {k: torch.empty(unit.part) for k in ("master", "exp_avg", "exp_avg_sq")}
        for sg in self.sub_groups:
            for p in sg.pieces:
                if p.hr is hr:
                    regions = self._regions(sg, self._hold(sg))
                    for t, (region, _) in zip(out.values(), regions, strict=True):
                        t[p.start : p.start + p.n].copy_(region[p.at : p.at + p.n])
        self.settle()
        return out

    # -- accounting and teardown -----------------------------------------------------------------

    def host_bytes(self) -> dict[str, int]:
        """``master``: the swap buffers (masters and moments of at most ``buffer_count``
        sub-groups); ``grads`` and ``staging`` as host offload."""
        grads = sum(hr.grad.numel() * 4 for hr in self.ranges)
        staging = sum(t.numel() * t.element_size() for t in self._staging.values())
        swap = sum(t.numel() * 4 + ALIGN for t in self._buffers)  # with the alignment slack
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
