"""The gradient path: from autograd's hooks to the fp32 gradient each rank's optimizer reads.

[Note: streaming reduction]
Each parameter's post-accumulate-grad hook copies its gradient into its unit's staging buffer
and drops it, so no full gradient outlives that copy. When every trainable parameter of a unit
has arrived, the unit's collective is issued at once — on a side stream from the stream hooks,
ordered after the producing stream by an event — while autograd goes on with the layers below.
Units are issued strictly in one fixed order on every rank (a unit that completes early waits
for the ones before it), so ranks whose backward skips a parameter still pair their
collectives; whatever is incomplete when backward returns is issued then, zeros standing in for
the missing gradients. Handles are waited for, and their buffers reused or read, only after
their ``wait()`` (the comm hookspec's ordering contract).

Per stage, by the engine's :class:`~ds_core.zero.placement.StagePlan`, one gradient path
(:mod:`ds_core.zero.grad_paths`, chosen once by ``path_for``) owns the units' buffers:

- stage 0 and stage 1 with accumulation (``LocalAllReduce``, ``LocalAccumulation``): every
  micro-batch's gradient is added into a full fp32 accumulator per unit; the last micro-batch
  of the window issues the all-reduce (stage 0) or reduce-scatter (stage 1) during its backward;
- stage 2, stage 3, and stage 1 without accumulation (``Streaming``; ``StreamingToHost`` under
  optimizer offload, summing into the host's accumulators): every micro-batch reduce-scatters
  through one of a few reusable staging buffers (``StagingPool``: two with ``overlap_comm``,
  double-buffering), and the reduced range is added into a persistent fp32 accumulator of
  ``part`` elements per unit. The staging buffers exist only while reductions are pending:
  taken from the allocator at a backward's first gradient and handed back once every
  collective completed, so the optimizer step (and everything between steps) runs without
  them (with a caching allocator the next backward gets the same blocks back at no cost).

The reducer itself keeps what the paths share: the issue order, the collectives in flight
(``Reduction`` records), the scaling below and the global norm.

Gradients are summed across ranks with DeepSpeed's scaling: ``prescale_gradients`` divides by the
number of data replicas (``world / sp_size``) before the collective, else
``gradient_predivide_factor`` divides before and the engine multiplies by ``factor / replicas``
at the step (:attr:`GradReducer.post_scale`), so the optimizer sees the mean over data replicas
of the sum over each replica's sequence-parallel ranks (DeepSpeed 0.19.8's
``runtime/zero/stage_1_and_2.py`` and ``stage3.py``: ``world / sequence_parallel_size``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ds_core.accelerator import Accelerator
from ds_core.comm.quantized import NodeGroups
from ds_core.types import Work
from ds_core.zero.grad_norm import GlobalNorm, sum_of_squares
from ds_core.zero.grad_paths import GradPath, Reduction, Streaming, UnitGrads, path_for
from ds_core.zero.partition import PIPE_REPLICATED_ATTR, FlatUnit, Mode, ZeroParam
from ds_core.zero.placement import StagePlan


class GradReducer:
    """Owns every gradient collective of the engine's backward, in issue order; its
    :attr:`path` owns the gradient buffers ([Note: streaming reduction]).

    :param units: the units holding trainable parameters, in the fixed issue order.
    :param world: ranks of ZeRO's group (data × sequence parallel): gradients are summed over
        it and divided by ``world // sp_size``, the data replicas (experts too, so every token of
        the global batch weighs the same).
    :param plan: the engine's stage plan, which picks the gradient path
        (:func:`~ds_core.zero.grad_paths.path_for`).
    :param acc: the accelerator (collectives, streams, events).
    :param comm_dtype: dtype gradients are reduced in (accumulation is always fp32).
    :param prescale: DeepSpeed's ``prescale_gradients``.
    :param predivide: DeepSpeed's ``gradient_predivide_factor``.
    :param overlap: ``overlap_comm``: asynchronous collectives on a side stream.
    :param tp_rank: this rank's tensor-parallel rank: units of TP-replicated parameters count
        in the global norm on TP rank 0 only (their gradients are equal across the TP group).
    :param tp_size: ranks of the TP group.
    :param pp_size: pipeline stages (the norm sums over ``world × tp_size × pp_size`` ranks:
        every stage's gradients, as DeepSpeed's pipeline clips).
    :param sp_size: sequence-parallel ranks within ``world``; they hold shards of the same
        sequences, so their gradients are summed, not averaged, as DeepSpeed does (each SP
        rank's loss is the full sequence's, docs/architecture.md §10). Must divide ``world``.
    :param norm_dtype: dtype the global norm is accumulated in.
    :param grad_dtype: dtype of the accumulators and the reduced ranges the optimizer reads:
        fp32, or bf16 with ``bf16.bf16_master_weights_and_grads`` (the norm stays in
        ``norm_dtype``).
    :param qgz: ZeRO++ ``zero_quantized_gradients``: the node groups of
        :func:`~ds_core.comm.quantized.quantized_reduce_scatter`, used for the units reduced
        over the whole world (experts keep exact reduce-scatters); ``None``: off.
    """

    def __init__(
        self,
        units: list[FlatUnit],
        world: int,
        plan: StagePlan,
        acc: Accelerator,
        comm_dtype: torch.dtype,
        prescale: bool,
        predivide: float,
        overlap: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_size: int = 1,
        sp_size: int = 1,
        norm_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype = torch.float32,
        qgz: NodeGroups | None = None,
    ) -> None:
        self.norm_dtype = norm_dtype
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.world = world
        #: the global norm over the whole mesh's ranks.
        self._norm = GlobalNorm(acc, world * tp_size * pp_size)
        self.acc = acc
        self.overlap = overlap
        self.units = [UnitGrads(u) for u in units if u.trainable]
        self._of: dict[int, UnitGrads] = {
            id(zp): ug for ug in self.units for zp in ug.unit.trainable
        }
        #: units another pipeline stage counts in the norm (a tied weight's copy; see
        #: ds_core.parallel.pipeline): left out of the norm as TP replicas are.
        self._pipe_replicas = {
            id(ug)
            for ug in self.units
            if all(getattr(zp.param, PIPE_REPLICATED_ATTR, False) for zp in ug.unit.zparams)
        }
        if sp_size < 1 or world % sp_size:
            raise ValueError(f"sp_size {sp_size} must be positive and divide the world {world}")
        #: data replicas: the divisor that turns the sum over the group into their mean.
        replicas = world // sp_size
        #: multiplier applied before the collective, and the one the step applies after.
        self.pre_scale = 1.0 / replicas if prescale else 1.0 / predivide
        self._post_scale = 1.0 if prescale else predivide / replicas
        #: collectives in flight, oldest first.
        self._inflight: deque[Reduction] = deque()
        #: the stage's gradient path (:mod:`ds_core.zero.grad_paths`): the units' buffers.
        self.path: GradPath = path_for(
            plan, self.units, acc, comm_dtype, grad_dtype, qgz, overlap, self._complete_oldest
        )
        self._stream = acc.Stream() if overlap else None
        #: optimizer offload's host accumulators (see :meth:`attach_host`), or ``None``.
        self.host: Any = None
        #: under offload, each unit's squared norm from its window's first contribution on
        #: the device; valid for the norm while no unit had a second one (``_host_single``),
        #: so a one-micro-batch window's norm needs no host read (see :meth:`global_norm`).
        self._host_partials: list[torch.Tensor] = []
        self._host_single = True
        #: reduce this backward (else accumulate locally).
        self.reducing = True
        #: average over the group (stage 0); false hands the optimizer this rank's own
        #: gradients, for one that communicates itself (see :mod:`ds_core.optim`).
        self.communicate = True
        #: the next unit index to issue in this backward.
        self._cursor = 0
        #: ``ignore_unused_parameters: false``: :meth:`check_every_gradient_arrived` raises
        #: at the step for a trainable parameter that got no gradient in the window.
        self.require_every_gradient = False
        self._arrived_in_window: set[int] = set()

    # -- backward ---------------------------------------------------------------------------

    def begin_backward(self, boundary: bool) -> None:
        """Called before each backward; ``boundary``: the micro-batch ends the window."""
        self.reducing = boundary or self.path.reduces_every_backward
        self._cursor = 0
        for ug in self.units:
            ug.arrived = 0
        self.path.begin_backward(self.units, self.reducing and self.communicate)

    def on_grad(self, zp: ZeroParam, grad: torch.Tensor) -> None:
        """The post-accumulate-grad hook: take ``grad`` into the unit's buffer."""
        ug = self._of[id(zp)]
        if self.require_every_gradient:
            self._arrived_in_window.add(id(zp))
        self.path.take(ug, zp, grad.detach().reshape(-1))
        if self.reducing:
            ug.arrived += 1
            if ug.arrived == len(ug.unit.trainable):
                self._issue_ready()

    def end_backward(self) -> None:
        """Issue every unit not issued yet (parameters without a gradient count as zeros)."""
        if not self.reducing:
            return
        while self._cursor < len(self.units):
            self._issue(self.units[self._cursor])
            self._cursor += 1
        if not self.overlap:
            self.finish()

    def _issue_ready(self) -> None:
        while self._cursor < len(self.units):
            ug = self.units[self._cursor]
            if ug.arrived < len(ug.unit.trainable):
                return
            self._issue(ug)
            self._cursor += 1

    def _issue(self, ug: UnitGrads) -> None:
        unit = ug.unit
        buf = self.path.bucket(ug)[: unit.padded]
        for zp in unit.trainable:
            if id(zp) not in ug.touched:  # no gradient reached it: it contributes zeros
                buf[zp.offset : zp.offset + zp.numel].zero_()
        buf[unit.numel :].zero_()
        if not self.communicate:
            # Stage 0 for an optimizer that communicates itself: the window's backwards keep
            # summing where they accumulate (``zero()`` ends the window).
            ug.opened = True
            return
        send = self.path.send(ug, buf)
        if self.pre_scale != 1.0:
            send.mul_(self.pre_scale)
        first = not ug.opened
        ug.opened = True
        out = self.path.output(ug, send, first)
        handle = self._collective(unit, out, send)
        self._inflight.append(Reduction(ug, handle, send, out, ug.staging, first))
        ug.staging = None
        if not self.overlap:
            self._complete_oldest()

    def _collective(self, unit: FlatUnit, out: torch.Tensor, send: torch.Tensor) -> Work:
        acc = self.acc
        if self._stream is None:
            return self.path.collective(unit, out, send, False)
        ready = acc.Event()
        ready.record()  # on the producing (current) stream
        with acc.stream(self._stream):
            self._stream.wait_event(ready)
            return self.path.collective(unit, out, send, True)

    def _complete_oldest(self) -> bool:
        """Wait for the oldest collective in flight and fold its result in; false when none
        was in flight."""
        if not self._inflight:
            return False
        done = self._inflight.popleft()
        done.handle.wait()  # orders the current stream after the collective
        if self.host is not None and done.first:
            # Optimizer offload: the window sums on the host; its first contribution's
            # squared norm is taken here, on the device (see :meth:`global_norm`).
            out = done.output
            part = sum_of_squares(
                out if out.dtype == torch.float32 else out.float(), self.norm_dtype
            )
            self._host_partials.append(part if not self._norm_replica(done.grads) else part * 0)
        elif self.host is not None:
            self._host_single = False
        self.path.land(done)
        return True

    @property
    def post_scale(self) -> float:
        """Multiplier the step applies to the reduced gradients: turns the group's sum into
        its mean (1 when gradients stay local, see :attr:`communicate`)."""
        return self._post_scale if self.communicate else 1.0

    def finish(self) -> None:
        """Wait for every collective in flight and fold its result in, then hand the staging
        buffers back to the allocator unless a unit is still filling one; idempotent."""
        while self._complete_oldest():
            pass
        self.path.drop_staging_if_idle(self.units)

    # -- the step -----------------------------------------------------------------------------

    def grad(self, zp: ZeroParam) -> torch.Tensor:
        """This rank's reduced fp32 gradient of ``zp`` (full-shaped at stage 0, else its
        flat piece). Valid after :meth:`finish` at the window's end."""
        ug = self._of[id(zp)]
        if zp.mode is Mode.REPLICATED:
            assert ug.local is not None
            return ug.local[zp.offset : zp.offset + zp.numel].view(zp.shape)
        if ug.reduced is None:
            raise RuntimeError(f"the gradient of {zp.name} was read before it was reduced")
        return ug.reduced[zp.shard_offset : zp.shard_offset + zp.shard_numel]

    def reduced_buffers(self) -> Iterator[torch.Tensor]:
        """This rank's reduced gradients that count in the global norm: a replicated unit
        counts only on its group's first rank, and a unit replicated across the TP group only
        on TP rank 0, so each element counts once in the world."""
        if self.host is not None:
            for ug in self.units:
                if not self._norm_replica(ug):
                    yield self.host.buffer(ug.unit)
            return
        for ug in self.units:
            if self._norm_replica(ug):
                continue
            buf = self.path.norm_buffer(ug)
            if buf is not None:
                yield buf

    def _norm_replica(self, ug: UnitGrads) -> bool:
        """Whether another rank counts ``ug`` in the norm: a TP replica off TP rank 0, or a
        tied weight's copy off the tie's first pipeline stage."""
        return id(ug) in self._pipe_replicas or (not ug.unit.tp_sharded and self.tp_rank != 0)

    def _tp_replica_buffers(self) -> Iterator[torch.Tensor]:
        """The reduced gradients :meth:`reduced_buffers` leaves out as replicas (their TP rank
        0, or their tie's first stage, counts them)."""
        for ug in self.units:
            if not self._norm_replica(ug):
                continue
            if self.host is not None:
                yield self.host.buffer(ug.unit)
            elif (buf := self.path.norm_buffer(ug)) is not None:
                yield buf

    def global_norm(self, dtype: torch.dtype) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, as a 0-dim ``dtype`` device tensor (one
        all-reduce over the world; never read on the host here). Non-finite when any rank
        holds a non-finite gradient, TP replicas included."""
        if not self.communicate:
            # Local gradients (an optimizer that communicates itself): this rank's own norm,
            # as DeepSpeed clips them; the engine agrees on skipping across ranks apart.
            return self._norm.local(
                (ug.reduced for ug in self.units if ug.reduced is not None), dtype
            )
        if self.host is not None and self._host_single and dtype == self.norm_dtype:
            # Offload, one contribution per unit this window: the device saw every gradient.
            return self._norm.of_squares(self._host_partials, dtype)
        if self.host is not None:
            # Offload, several contributions: the host waits for its accumulators once.
            self.host.land()
            return self._norm.of_host(self.reduced_buffers(), self._tp_replica_buffers(), dtype)
        return self._norm.of(self.reduced_buffers(), self._tp_replica_buffers(), dtype)

    def attach_host(self, host: Any) -> bool:
        """Optimizer offload: sum each micro-batch's reduced range straight into ``host``'s
        accumulators and keep none on the device (only where every backward reduces; stage 1
        with accumulation reduces once per window and hands its range over at the step).

        ``host`` provides ``accumulate(unit, reduced)`` (after every collective),
        ``zero()`` (each window's start) and ``buffer(unit)`` (the host range, for the norm),
        and must hold every unit. Returns whether it was attached.
        """
        if not isinstance(self.path, Streaming):
            return False
        if not all(host.holds(ug.unit) for ug in self.units):
            return False
        self.finish()
        self.host = host
        self.path = self.path.to_host(self.units, host)  # drops the device accumulators
        host.zero()
        return True

    def reduced_ranges(self) -> Iterator[tuple[FlatUnit, torch.Tensor]]:
        """Each partitioned unit with this rank's reduced fp32 range (``part`` elements), for
        optimizer offload. Valid after :meth:`finish` at the window's end."""
        for ug in self.units:
            if (reduced := self.path.reduced_range(ug)) is not None:
                yield ug.unit, reduced

    def scale_(self, factor: float | torch.Tensor) -> None:
        """Multiply every reduced gradient by ``factor`` (a float or a 0-dim device tensor)."""
        for ug in self.units:
            if ug.reduced is None:
                continue
            ug.reduced.mul_(factor)

    def check_every_gradient_arrived(self) -> None:
        """With :attr:`require_every_gradient`, raise unless every trainable parameter got a
        gradient in this window.

        :raises RuntimeError: naming the parameters without one and the config key.
        """
        if not self.require_every_gradient:
            return
        seen = self._arrived_in_window
        missing = [zp.name for ug in self.units for zp in ug.unit.trainable if id(zp) not in seen]
        if missing:
            raise RuntimeError(
                f"{len(missing)} trainable parameter(s) got no gradient in this step "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}), and "
                "zero_optimization.ignore_unused_parameters is false: set it true (their "
                "gradients then count as zeros), or make every trainable parameter take part "
                "in the loss"
            )

    def zero(self) -> None:
        """Drop every accumulated gradient (after a step, a skipped step, or ``zero_grad``)."""
        self.finish()
        self._arrived_in_window.clear()
        if self.host is not None:
            self.host.zero()  # the next window starts from zeros on the host
            self._host_partials.clear()
            self._host_single = True
        for ug in self.units:
            ug.opened = False
            ug.touched.clear()
            ug.arrived = 0
            self.path.zero(ug)

    def nbytes(self) -> int:
        """Bytes of the persistent gradient buffers (accumulators; staging counted apart)."""
        return sum(self.path.nbytes(ug) for ug in self.units)

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers taken now (one unit each; none between steps)."""
        return self.path.staging_bytes()

    def release(self) -> None:
        """Free every buffer (engine teardown)."""
        self.finish()
        self.path.release(self.units)
        self.units.clear()
        self._of.clear()
