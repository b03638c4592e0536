"""The reducer's two gradient paths, one class each, chosen once from the stage plan.

:class:`~ds_core.zero.reducer.GradReducer` keeps what every path shares — the issue order, the
collectives in flight, the scaling and the global norm — and hands each unit's buffers to one
:class:`GradPath` ([Note: streaming reduction] in ``ds_core/zero/reducer.py``):

- :class:`LocalAccumulation` (stage 1 with gradient accumulation): a full accumulator per unit
  summed over the window's micro-batches, reduce-scattered by the window's last backward;
  :class:`LocalAllReduce` (stage 0) all-reduces it in place instead.
- :class:`Streaming` (stages 2 and 3, stage 1 without accumulation): every backward copies into
  a pooled staging buffer (:class:`StagingPool`) that is reduce-scattered at once and summed into
  a persistent ``part``-sized accumulator; :class:`StreamingToHost` (optimizer offload) sums
  into the offload's host accumulators instead.

A path decides where :meth:`GradPath.take` copies a gradient, which buffer a unit's collective
sends (:meth:`GradPath.bucket`, :meth:`GradPath.send`) and where it lands
(:meth:`GradPath.output`, :meth:`GradPath.land`), and what :meth:`GradPath.zero`,
:meth:`GradPath.nbytes` and :meth:`GradPath.release` do with its buffers. Nothing outside
:func:`path_for` reads the plan's flags.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_core.accelerator import Accelerator
from ds_core.comm.quantized import NodeGroups, quantized_reduce_scatter
from ds_core.types import Work
from ds_core.zero.partition import FlatUnit, ZeroParam
from ds_core.zero.placement import StagePlan


class UnitGrads:
    """One unit's gradient buffers (which of them exist is its :class:`GradPath`'s choice)."""

    __slots__ = ("arrived", "local", "opened", "reduced", "staging", "touched", "unit")

    def __init__(self, unit: FlatUnit) -> None:
        self.unit = unit
        #: full accumulator (local paths; :class:`LocalAllReduce` reduces it in place).
        self.local: torch.Tensor | None = None
        #: this rank's reduced range (``part`` elements; :class:`LocalAllReduce`: ``local``).
        self.reduced: torch.Tensor | None = None
        #: the pooled staging buffer this micro-batch's gradients are copied into
        #: (:class:`Streaming`; the unit uses its first ``padded`` elements).
        self.staging: torch.Tensor | None = None
        #: whether a reduction into ``reduced`` was issued in this window (later ones add).
        self.opened = False
        #: parameters whose gradient arrived in this backward (or, locally, in this window).
        self.touched: set[int] = set()
        self.arrived = 0


@dataclass(eq=False)
class Reduction:
    """A gradient collective in flight: the handle, the buffer it reads (the bucket, or its cast
    to the communication dtype) and the one it writes, both kept alive until ``wait()`` as the
    comm hookspec requires; ``staging`` goes back to the pool then, and ``first`` says whether
    this is the window's first contribution to the unit."""

    grads: UnitGrads
    handle: Work
    input: torch.Tensor
    output: torch.Tensor
    staging: torch.Tensor | None
    first: bool


#: completes the oldest collective in flight; false when none was in flight.
CompleteOldest = Callable[[], bool]


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class GradPath:
    """Where one stage's gradients are kept between autograd's hooks and the optimizer.

    :param units: the reducer's units (their buffers are allocated here).
    :param acc: the accelerator (collectives).
    :param comm_dtype: dtype gradients are reduced in.
    :param grad_dtype: dtype of the accumulators and the reduced ranges.
    :param qgz: ZeRO++ qgZ node groups for reduce-scatters over the whole world, or ``None``.
    :param complete_oldest: the reducer's way to wait for its oldest collective (a path that
        needs a buffer back, or a result settled, calls it).
    """

    #: every backward reduces (else only the window's last one).
    reduces_every_backward = False

    def __init__(
        self,
        units: list[UnitGrads],
        acc: Accelerator,
        comm_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        qgz: NodeGroups | None,
        complete_oldest: CompleteOldest,
    ) -> None:
        self.acc = acc
        self.device = acc.device()
        self.comm_dtype = comm_dtype
        self.grad_dtype = grad_dtype
        self.qgz = qgz
        self.complete_oldest = complete_oldest
        for ug in units:
            self.allocate(ug)

    def allocate(self, ug: UnitGrads) -> None:
        """Make ``ug``'s persistent buffers."""
        raise NotImplementedError

    def begin_backward(self, units: list[UnitGrads], reducing: bool) -> None:
        """Before a backward; ``reducing``: it issues collectives (the reducer communicates)."""

    def take(self, ug: UnitGrads, zp: ZeroParam, grad: torch.Tensor) -> None:
        """Copy (or add) ``zp``'s flat gradient ``grad`` into ``ug``'s buffer."""
        raise NotImplementedError

    def bucket(self, ug: UnitGrads) -> torch.Tensor:
        """The buffer holding ``ug``'s gradients when its collective is issued."""
        raise NotImplementedError

    def send(self, ug: UnitGrads, buf: torch.Tensor) -> torch.Tensor:
        """The tensor the collective reads: ``buf`` (the bucket's ``padded`` elements), or its
        copy in the communication dtype."""
        return buf

    def output(self, ug: UnitGrads, send: torch.Tensor, first: bool) -> torch.Tensor:
        """The tensor the collective writes; ``first``: the window's first contribution."""
        return torch.empty(ug.unit.part, dtype=self.comm_dtype, device=self.device)

    def collective(
        self, unit: FlatUnit, out: torch.Tensor, send: torch.Tensor, async_op: bool
    ) -> Work:
        """Reduce-scatter ``send`` into ``out`` over the unit's group (qgZ over the world, in
        the unit's block; a unit of 1-D parameters only is reduced exactly, as DeepSpeed's)."""
        if self.qgz is not None and unit.group is None and unit.qgz_block:
            return quantized_reduce_scatter(out, send, self.qgz, async_op, unit.qgz_block)
        return self.acc.reduce_scatter(out, send, "sum", unit.group, async_op)

    def land(self, done: Reduction) -> None:
        """Fold a completed collective's output into the unit's reduced range."""
        raise NotImplementedError

    def zero(self, ug: UnitGrads) -> None:
        """Drop ``ug``'s accumulated gradient (the window's end)."""

    def drop_staging_if_idle(self, units: list[UnitGrads]) -> None:
        """After every collective completed: hand staging back to the allocator."""

    def norm_buffer(self, ug: UnitGrads) -> torch.Tensor | None:
        """``ug``'s reduced gradient as this rank counts it in the global norm, or ``None``."""
        return ug.reduced

    def reduced_range(self, ug: UnitGrads) -> torch.Tensor | None:
        """``ug``'s reduced ``part``-sized range (optimizer offload reads it), or ``None``."""
        return ug.reduced

    def nbytes(self, ug: UnitGrads) -> int:
        """Bytes of ``ug``'s persistent accumulator."""
        raise NotImplementedError

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers taken now."""
        return 0

    def release(self, units: list[UnitGrads]) -> None:
        """Free every buffer (engine teardown)."""
        for ug in units:
            ug.local = ug.reduced = ug.staging = None


class LocalAccumulation(GradPath):
    """Stage 1 with accumulation: a full ``padded`` accumulator per unit sums the window's
    micro-batches; the window's last backward reduce-scatters it and the reduced range lives
    until the window ends (it is the optimizer's gradient).

    The reduced range lands in this rank's own range of the accumulator, which the window no
    longer needs once its reduce-scatter completed: the collective's output is freed as it
    lands, so the optimizer step runs on the held model states (bench/memory_formula.py, row
    ``1/gas4``: a separate range per unit held 4Ψ/N more through the step, 1.33 of ZeRO's
    formula on the GPT example; tests/zero/test_zero_peak_memory.py).
    """

    def begin_backward(self, units: list[UnitGrads], reducing: bool) -> None:
        if not reducing:
            return
        for ug in units:
            if ug.reduced is not None:
                # A second reducing backward in one window (a GAN's two discriminator
                # losses): its gradients overwrite the accumulator, and with it the first
                # result, which is set aside (it is added to the second's as that lands).
                while self.complete_oldest():
                    pass
                ug.reduced = ug.reduced.clone()

    def allocate(self, ug: UnitGrads) -> None:
        ug.local = torch.zeros(ug.unit.padded, dtype=self.grad_dtype, device=self.device)

    def take(self, ug: UnitGrads, zp: ZeroParam, grad: torch.Tensor) -> None:
        assert ug.local is not None
        dst = ug.local[zp.offset : zp.offset + zp.numel]
        if id(zp) in ug.touched:
            dst.add_(grad)
        else:
            dst.copy_(grad)
            ug.touched.add(id(zp))

    def bucket(self, ug: UnitGrads) -> torch.Tensor:
        assert ug.local is not None
        return ug.local

    def send(self, ug: UnitGrads, buf: torch.Tensor) -> torch.Tensor:
        ug.touched.clear()  # the next window's first gradient copies
        # The cast is a fresh buffer; the reduction record keeps it alive until wait().
        return buf.to(self.comm_dtype) if self.comm_dtype != self.grad_dtype else buf

    def land(self, done: Reduction) -> None:
        ug, out = done.grads, done.output
        if ug.reduced is None:  # the range lives during the step, inside the accumulator
            assert ug.local is not None
            start = ug.unit.rank * ug.unit.part
            ug.reduced = ug.local[start : start + ug.unit.part]
            ug.reduced.copy_(out)  # casts from the communication dtype
        else:  # a second reducing backward in the window
            ug.reduced.add_(out)

    def zero(self, ug: UnitGrads) -> None:
        ug.reduced = None

    def nbytes(self, ug: UnitGrads) -> int:
        return _bytes(ug.local)


class LocalAllReduce(LocalAccumulation):
    """Stage 0: as :class:`LocalAccumulation`, but the window's last backward all-reduces the
    accumulator in place, which is then every rank's whole gradient (``reduced`` is ``local``)."""

    def allocate(self, ug: UnitGrads) -> None:
        super().allocate(ug)
        ug.reduced = ug.local

    def begin_backward(self, units: list[UnitGrads], reducing: bool) -> None:
        if not reducing:
            return
        for ug in units:
            if ug.opened and ug.local is not None:
                # A second reducing backward in one window (a GAN's two discriminator
                # losses): the all-reduce works in place, so the first result is set aside
                # and added back when the second completes.
                while self.complete_oldest():
                    pass
                ug.reduced = ug.local.clone()

    def output(self, ug: UnitGrads, send: torch.Tensor, first: bool) -> torch.Tensor:
        return send

    def collective(
        self, unit: FlatUnit, out: torch.Tensor, send: torch.Tensor, async_op: bool
    ) -> Work:
        return self.acc.all_reduce(out, "sum", unit.group, async_op)

    def land(self, done: Reduction) -> None:
        ug, out = done.grads, done.output
        assert ug.local is not None
        if out is not ug.local:
            ug.local.copy_(out)
        if ug.reduced is not None and ug.reduced is not ug.local:
            ug.local.add_(ug.reduced)
            ug.reduced = ug.local

    def zero(self, ug: UnitGrads) -> None:
        pass  # ``reduced`` is the accumulator itself, overwritten by the next window's copies

    def norm_buffer(self, ug: UnitGrads) -> torch.Tensor | None:
        # Every rank of the group holds the whole gradient: its first rank counts it.
        return ug.reduced if ug.unit.group_rank == 0 else None

    def reduced_range(self, ug: UnitGrads) -> torch.Tensor | None:
        return None  # not partitioned


class StagingPool:
    """The staging buffers of :class:`Streaming`: one unit's ``capacity`` elements each, up to
    ``depth`` in use before the oldest collective is waited for (two with ``overlap_comm``).

    :param complete_oldest: waits for the reducer's oldest collective, whose staging buffer
        comes back through :meth:`give`.
    """

    def __init__(
        self,
        capacity: int,
        depth: int,
        dtype: torch.dtype,
        device: torch.device,
        complete_oldest: CompleteOldest,
    ) -> None:
        self.capacity = capacity
        self.depth = depth
        self.dtype = dtype
        self.device = device
        self.complete_oldest = complete_oldest
        #: every staging buffer taken from the allocator, and those not in use.
        self.pool: list[torch.Tensor] = []
        self.free: deque[torch.Tensor] = deque()

    def take(self) -> torch.Tensor:
        """A free buffer: waits for collectives while ``depth`` buffers are in use."""
        while not self.free and len(self.pool) >= self.depth and self.complete_oldest():
            pass
        if self.free:
            return self.free.popleft()
        # Below the depth, or every buffer held by a unit waiting for an earlier one
        # (gradients arriving out of the issue order): take one more rather than stall.
        buf = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
        self.pool.append(buf)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` is free again (its collective completed, or its window was dropped)."""
        self.free.append(buf)

    def clear(self) -> None:
        """Hand every buffer back to the allocator."""
        self.pool.clear()
        self.free.clear()

    def nbytes(self) -> int:
        return sum(_bytes(b) for b in self.pool)


class Streaming(GradPath):
    """Stages 2 and 3, and stage 1 without accumulation: every backward copies each gradient
    into a pooled staging buffer, reduce-scatters it as soon as the unit is complete and sums
    the reduced range into a persistent ``part``-sized accumulator (the window's first
    contribution lands there in place when no cast is needed).

    :param overlap: ``overlap_comm``: two staging buffers in use before waiting, else one.
    """

    reduces_every_backward = True

    def __init__(
        self,
        units: list[UnitGrads],
        acc: Accelerator,
        comm_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        qgz: NodeGroups | None,
        complete_oldest: CompleteOldest,
        overlap: bool,
    ) -> None:
        super().__init__(units, acc, comm_dtype, grad_dtype, qgz, complete_oldest)
        self.overlap = overlap
        capacity = max((ug.unit.padded for ug in units), default=0)
        self.staging = StagingPool(
            capacity, 2 if overlap else 1, comm_dtype, self.device, complete_oldest
        )

    def allocate(self, ug: UnitGrads) -> None:
        ug.reduced = torch.zeros(ug.unit.part, dtype=self.grad_dtype, device=self.device)

    def begin_backward(self, units: list[UnitGrads], reducing: bool) -> None:
        for ug in units:
            ug.touched.clear()

    def take(self, ug: UnitGrads, zp: ZeroParam, grad: torch.Tensor) -> None:
        if ug.staging is None:
            ug.staging = self.staging.take()
        ug.staging[zp.offset : zp.offset + zp.numel].copy_(grad)
        ug.touched.add(id(zp))

    def bucket(self, ug: UnitGrads) -> torch.Tensor:
        if ug.staging is None:  # no gradient reached the unit in this backward
            ug.staging = self.staging.take()
        return ug.staging

    def output(self, ug: UnitGrads, send: torch.Tensor, first: bool) -> torch.Tensor:
        if first and self.comm_dtype == self.grad_dtype:
            assert ug.reduced is not None
            return ug.reduced  # the window's first contribution lands in place
        return super().output(ug, send, first)

    def land(self, done: Reduction) -> None:
        if done.staging is not None:
            self.staging.give(done.staging)
        ug, out = done.grads, done.output
        assert ug.reduced is not None
        if out is not ug.reduced:
            if done.first:
                ug.reduced.copy_(out)
            else:
                ug.reduced.add_(out)

    def zero(self, ug: UnitGrads) -> None:
        if ug.staging is not None:
            self.staging.give(ug.staging)
            ug.staging = None
        if ug.reduced is not None:
            ug.reduced.zero_()  # a bucket nobody reduces this window must read as zeros

    def drop_staging_if_idle(self, units: list[UnitGrads]) -> None:
        # A unit still filling a buffer (finish() inside a backward) keeps the pool.
        if self.staging.pool and all(ug.staging is None for ug in units):
            self.staging.clear()

    def nbytes(self, ug: UnitGrads) -> int:
        return _bytes(ug.reduced)

    def staging_bytes(self) -> int:
        return self.staging.nbytes()

    def release(self, units: list[UnitGrads]) -> None:
        super().release(units)
        self.staging.clear()

    def to_host(self, units: list[UnitGrads], host: Any) -> StreamingToHost:
        """This path summing into ``host``'s accumulators instead (no collective may be in
        flight: the device accumulators of ``units`` are dropped)."""
        args = (self.acc, self.comm_dtype, self.grad_dtype, self.qgz, self.complete_oldest)
        return StreamingToHost(units, *args, self.overlap, host)


class StreamingToHost(Streaming):
    """:class:`Streaming` under optimizer offload: each micro-batch's reduced range is summed
    straight into the offload's host accumulators and no accumulator stays on the device.

    :param host: provides ``accumulate(unit, reduced)`` (see
        :meth:`~ds_core.zero.reducer.GradReducer.attach_host`).
    """

    def __init__(
        self,
        units: list[UnitGrads],
        acc: Accelerator,
        comm_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        qgz: NodeGroups | None,
        complete_oldest: CompleteOldest,
        overlap: bool,
        host: Any,
    ) -> None:
        super().__init__(units, acc, comm_dtype, grad_dtype, qgz, complete_oldest, overlap)
        self.host = host

    def allocate(self, ug: UnitGrads) -> None:
        ug.reduced = None  # the device accumulators are not needed

    def output(self, ug: UnitGrads, send: torch.Tensor, first: bool) -> torch.Tensor:
        return torch.empty(ug.unit.part, dtype=self.comm_dtype, device=self.device)

    def land(self, done: Reduction) -> None:
        if done.staging is not None:
            self.staging.give(done.staging)
        self.host.accumulate(done.grads.unit, done.output)


def path_for(
    plan: StagePlan,
    units: list[UnitGrads],
    acc: Accelerator,
    comm_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    qgz: NodeGroups | None,
    overlap: bool,
    complete_oldest: CompleteOldest,
) -> GradPath:
    """The gradient path of ``plan`` (see the module docstring), its buffers allocated.

    :raises ValueError: a plan that all-reduces without accumulating locally (no stage does).
    """
    if plan.all_reduces_gradients and not plan.accumulates_locally:
        raise ValueError(
            "StagePlan: all_reduces_gradients needs accumulates_locally (only stage 0 "
            "all-reduces, from its local accumulator); build plans with StagePlan.for_stage"
        )
    args = (units, acc, comm_dtype, grad_dtype, qgz, complete_oldest)
    if plan.all_reduces_gradients:
        return LocalAllReduce(*args)
    if plan.accumulates_locally:
        return LocalAccumulation(*args)
    return Streaming(*args, overlap)
