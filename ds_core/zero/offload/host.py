"""Optimizer offload (``zero_optimization.offload_optimizer.device = "cpu"``), stages 1-3.

[Note: offload data path]
Per unit (the engine's flat reduce/gather group), this rank's range lives on the host twice:
``master`` (fp32, the masters the optimizer steps are views of it) and ``grad`` (fp32, what the
host optimizer reads). Optimizer state is created by the optimizer on the host, next to the
masters. At each window's boundary:

1. where the reducer reduces every micro-batch (stages 2/3, stage 1 without accumulation),
   each micro-batch's reduced range goes to the host as soon as its collective completes
   (``GradReducer.attach_host``): the window's first one is copied into ``grad``, later ones
   through the range's staging buffer and added on the host once they arrived (polled, not
   waited for); the device keeps no gradient accumulator;
2. stage 1 with accumulation reduces once per window: that range is copied device -> host
   into ``grad`` at the step (non-blocking into pinned memory where the backend has it, one
   event ordering the host's reads after the copies). Parameters that got no gradient read as
   zeros either way (the reducer zero-fills them before the collective);
3. the optimizer steps on the host; ``DeepSpeedCPUAdam`` (the default with offload) takes the
   unscale/average/clip multiplier in the same pass (``grad_scale``), any other optimizer
   gets gradients already scaled on the device;
4. each updated range goes host -> device: for 16-bit models through one reusable staging
   buffer in the parameters' dtype, sized to the largest range (cast on the host, so the copy
   moves 16-bit values), an event per copy ordering the buffer's reuse after it; for fp32
   models straight from the master (no cast needed, so no staging copy).

Host syncs per step (counted by the simulated accelerator, tests/zero/test_zero_syncs.py): the
host optimizer must read the gradients, so the step waits once for the gradients, the
clipping multiplier and the skip verdict together (:meth:`OptimizerOffload.gradients_to_host`):
**1**. A window of one micro-batch computes its norm on the device as the gradients pass; with
accumulation at stages 2/3 the norm is of the host sums, which the host waits for first: **2**.
16-bit models add one per unit after the first, each waiting for the staging buffer's
previous copy before reusing it (host memory for one range, not one per unit).

Then the engine's usual all-gather (stages 1/2) rebuilds full parameters; stage 3 keeps the
range. With ``offload_param`` the stage-3 range itself is on the host: step 4 is a host-side
cast into it, and the device sees the parameters only while a gather holds them. Where pinned,
every host buffer is allocated page-locked (``alloc_pinned``) and handed back at engine
teardown (``free_pinned``). On the CPU backend every copy is host to host and nothing is
pinned (the backend declares ``pinned_memory`` absent), but the path is the same one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ds_core.accelerator import Accelerator
from ds_core.ops.cpu_adam import DeepSpeedCPUAdam
from ds_core.zero.partition import FlatUnit

log = logging.getLogger("ds_core.zero")

__all__ = ["OptimizerOffload"]


class _HostRange:
    """One unit's host buffers: ``master`` and ``grad``, ``part`` fp32 elements each, and the
    window's accumulation state: ``fresh`` (no contribution yet: the next one is copied, not
    added), ``landed`` (the event after the contribution in flight), ``staged`` (that one
    is in ``staging``, to be added into ``grad`` once it arrived)."""

    __slots__ = ("fresh", "grad", "landed", "master", "staged", "staging", "unit")

    def __init__(self, unit: FlatUnit, master: torch.Tensor, grad: torch.Tensor) -> None:
        self.unit, self.master, self.grad = unit, master, grad
        self.fresh = True
        self.staging: torch.Tensor | None = None
        self.landed: Any = None
        self.staged = False


class OptimizerOffload:
    """Owns the host side of optimizer offload (see [Note: offload data path]).

    :param acc: the accelerator (capabilities, pinning, events).
    :param pin_memory: the config's ``pin_memory``; honoured only where the backend declares
        ``pinned_memory``.
    """

    #: the masters and moments live in swap files, not host memory (NVMe offload).
    in_files = False

    def __init__(self, acc: Accelerator, pin_memory: bool) -> None:
        self.acc = acc
        self.pinned = bool(pin_memory) and "pinned_memory" in acc.capabilities
        if pin_memory and not self.pinned:
            log.info(
                "offload_optimizer: backend '%s' does not declare pinned_memory; host buffers "
                "are pageable and host<->device copies are synchronous",
                acc.name,
            )
        self.ranges: list[_HostRange] = []
        self._of: dict[int, _HostRange] = {}
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        #: the step's gradient multiplier as it lands on the host (one fp32 element).
        self._mult: torch.Tensor | None = None
        self._mult_value = 1.0
        #: every buffer taken from ``alloc_pinned``, handed back by :meth:`release`.
        self._pinned_buffers: list[torch.Tensor] = []

    def _host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host buffer: allocated page-locked where pinned (no pageable buffer and
        copy first), pageable otherwise."""
        if not self.pinned:
            return torch.zeros(numel, dtype=dtype, device="cpu")
        t = self.acc.alloc_pinned((numel,), dtype)
        self._pinned_buffers.append(t)
        return t.zero_()

    def _drop(self, t: torch.Tensor) -> None:
        """Hand a buffer from :meth:`_host` back now (pinned) or leave it to the collector."""
        for i, owned in enumerate(self._pinned_buffers):
            if owned is t:
                del self._pinned_buffers[i]
                self.acc.free_pinned(t)
                return

    # -- construction ----------------------------------------------------------------------------

    def make_masters(self, units: Iterable[FlatUnit]) -> None:
        """Allocate each unit's host range and point every trainable parameter's master at
        its piece of it, initialised from the unit's current (device) values."""
        with torch.no_grad():
            for unit in units:
                if unit.host_shard and unit.dtype == torch.float32 and unit.swapper is None:
                    # An fp32 host shard (offload_param) already is the master's dtype on the
                    # master's device: the optimizer steps it in place, no second copy (a
                    # swapped shard is not persistent: it gets a master of its own).
                    master = unit.owned()
                else:
                    master = self._host(unit.part, torch.float32)
                    master.copy_(unit.owned())  # device -> host, cast to fp32 on the way
                grad = self._host(unit.part, torch.float32)
                hr = _HostRange(unit, master, grad)
                self.ranges.append(hr)
                self._of[id(unit)] = hr
                for zp in unit.trainable:
                    piece = slice(zp.shard_offset, zp.shard_offset + zp.shard_numel)
                    zp.master = nn.Parameter(master[piece])
                if unit.dtype == torch.float32 or unit.host_shard:
                    # fp32: the master itself is the copy's source; a host shard
                    # (offload_param) takes the cast on the host: no staging either way.
                    continue
                staging = self._staging.get(unit.dtype)
                if staging is None or staging.numel() < unit.part:
                    self._staging[unit.dtype] = self._host(unit.part, unit.dtype)
                    if staging is not None:
                        self._drop(staging)  # outgrown: nothing else references it

    def holds(self, unit: FlatUnit | None) -> bool:
        """Whether ``unit``'s masters live on the host."""
        return unit is not None and id(unit) in self._of

    # -- host accumulation (the reducer calls these, see GradReducer.attach_host) -------------

    def accumulate(self, unit: FlatUnit, reduced: torch.Tensor) -> None:
        """Add one micro-batch's reduced range (device, any float dtype) into the host range.

        Without a host wait where memory is pinned: the window's first contribution is copied
        straight into ``grad`` (non-blocking), a later one into the range's staging buffer,
        added on the host when it has arrived (polled at the range's next contribution, so
        normally without waiting; everything lands at :meth:`gradients_to_host`).
        """
        hr = self._of[id(unit)]
        with torch.no_grad():
            if reduced.device.type == "cpu" or not self.pinned:
                hr.grad.add_(reduced.to("cpu", torch.float32))  # synchronous either way
                hr.fresh = False
                return
            src = reduced if reduced.dtype == torch.float32 else reduced.float()
            self._settle_range(hr)  # the previous contribution is in ``grad``
            if hr.fresh:
                hr.grad.copy_(src, non_blocking=True)
                hr.fresh = False
            else:
                if hr.staging is None:
                    hr.staging = self._host(unit.part, torch.float32)
                hr.staging.copy_(src, non_blocking=True)
                hr.staged = True
            hr.landed = self.acc.Event()
            hr.landed.record()

    def _settle_range(self, hr: _HostRange, *, arrived: bool = False) -> None:
        """Finish ``hr``'s contribution in flight: wait for it unless it has (or ``arrived``
        says it has) landed, then add a staged one into ``grad``."""
        if hr.landed is None:
            return
        if not arrived and not hr.landed.query():
            hr.landed.synchronize()
        hr.landed = None
        if hr.staged:
            assert hr.staging is not None
            hr.grad.add_(hr.staging)
            hr.staged = False

    def zero(self) -> None:
        """Start an accumulation window: every host range reads zeros (parameters that get no
        gradient in the window then contribute exact zeros)."""
        for hr in self.ranges:
            hr.landed, hr.staged, hr.fresh = None, False, True
            hr.grad.zero_()

    def buffer(self, unit: FlatUnit) -> torch.Tensor:
        """``unit``'s host gradient range (``part`` fp32 elements)."""
        return self._of[id(unit)].grad

    # -- the step ----------------------------------------------------------------------------

    def gradients_to_host(
        self,
        reduced: Iterable[tuple[FlatUnit, torch.Tensor]],
        mult: float | torch.Tensor,
        verdict: Callable[[], None] | None = None,
    ) -> float:
        """Land the window's gradients on the host and return ``mult`` as a host number.

        Copies each unit's reduced fp32 range (on the device) into its host ``grad``, queues
        the multiplier's copy (and calls ``verdict``, which queues the skip verdict's), then
        waits once for all of it: the step's one host sync under offload (see
        [Note: offload data path]). Points the masters' ``.grad`` at their pieces.
        """
        self._land(reduced, mult, verdict)
        for hr in self.ranges:
            for zp in hr.unit.trainable:
                if zp.master is not None:
                    zp.master.grad = hr.grad[zp.shard_offset : zp.shard_offset + zp.shard_numel]
        return self._mult_value

    def land(self) -> None:
        """Wait for every contribution in flight and add the staged ones (one host sync when
        any is still on its way)."""
        if any(hr.landed is not None for hr in self.ranges):
            done = self.acc.Event()
            done.record()
            if not done.query():
                done.synchronize()
        for hr in self.ranges:
            self._settle_range(hr, arrived=True)

    def _land(
        self,
        reduced: Iterable[tuple[FlatUnit, torch.Tensor]],
        mult: float | torch.Tensor,
        verdict: Callable[[], None] | None,
    ) -> None:
        for unit, device_range in reduced:
            hr = self._of.get(id(unit))
            if hr is None:
                continue
            hr.grad.copy_(device_range, non_blocking=self.pinned)
        if isinstance(mult, torch.Tensor):
            if self._mult is None:
                self._mult = self._host(1, torch.float32)
            self._mult.copy_(mult.reshape(1), non_blocking=self.pinned)
        if verdict is not None:
            verdict()
        if self.pinned:
            done = self.acc.Event()
            done.record()
            if not done.query():
                done.synchronize()  # the host optimizer reads these buffers next
        for hr in self.ranges:
            self._settle_range(hr, arrived=True)
        landed = self._mult if isinstance(mult, torch.Tensor) else None
        self._mult_value = float(mult) if landed is None else float(landed[0])

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float | None) -> None:
        """Run the host optimizer; ``grad_scale`` is fused into ``DeepSpeedCPUAdam``'s pass
        (``None``: the gradients were already scaled)."""

        if isinstance(optimizer, DeepSpeedCPUAdam):
            optimizer.step(grad_scale=1.0 if grad_scale is None else grad_scale)
            return
        if grad_scale is not None and grad_scale != 1.0:
            for hr in self.ranges:
                hr.grad.mul_(grad_scale)
        optimizer.step()

    def publish(self) -> None:
        """Copy every updated host range into its unit's device range, through the staging
        buffer of the parameters' dtype (cast on the host)."""
        in_flight: dict[torch.dtype, Any] = {}  # staging buffer -> its copy's event
        with torch.no_grad():
            for hr in self.ranges:
                unit = hr.unit
                if unit.host_shard:  # offload_param: host to host, cast on the way
                    if hr.master.data_ptr() != unit.owned().data_ptr():
                        unit.owned().copy_(hr.master)
                    continue
                if unit.dtype == torch.float32:
                    # The host master stays unchanged until the next step, whose gradient copy
                    # waits for all queued work: this copy may run asynchronously.
                    unit.owned().copy_(hr.master, non_blocking=self.pinned)
                    continue
                previous = in_flight.pop(unit.dtype, None)
                if previous is not None:
                    # Reusing the staging buffer: wait for its last copy to have read it (the
                    # last range's copy is waited for by the next step's landing instead).
                    previous.synchronize()
                staging = self._staging[unit.dtype][: unit.part]
                staging.copy_(hr.master)
                unit.owned().copy_(staging, non_blocking=self.pinned)
                if self.pinned:
                    in_flight[unit.dtype] = self.acc.Event()
                    in_flight[unit.dtype].record()

    # -- accounting and teardown -----------------------------------------------------------------

    def host_bytes(self) -> dict[str, int]:
        """Host bytes of the offload buffers: ``master``, ``grads`` (fp32 accumulators the
        optimizer reads), ``staging``; optimizer state is counted by the engine. An fp32 host
        shard that is its own master (``offload_param``) counts as parameters, not here."""
        master = sum(
            hr.master.numel() * 4
            for hr in self.ranges
            if hr.unit.swapper is not None or hr.master.data_ptr() != hr.unit.owned().data_ptr()
        )
        grads = sum(hr.grad.numel() * 4 for hr in self.ranges)
        staging = sum(t.numel() * t.element_size() for t in self._staging.values())
        return {"master": master, "grads": grads, "staging": staging}

    def uses_fused_scale(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` takes the gradient multiplier in its own pass."""

        return isinstance(optimizer, DeepSpeedCPUAdam)

    def release(self) -> None:
        """Drop every host buffer (engine teardown); pinned ones are freed now, through
        ``free_pinned``, so their page-locked memory goes back even while the caller still
        holds the optimizer (whose parameters are views of the masters: unusable after)."""
        for hr in self.ranges:
            for zp in hr.unit.trainable:
                zp.master = None
        self.ranges.clear()
        self._of.clear()
        self._staging.clear()
        buffers, self._pinned_buffers = self._pinned_buffers, []
        for t in buffers:
            self.acc.free_pinned(t)
