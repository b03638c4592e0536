"""The optimizer step at an accumulation boundary: the update and its bookkeeping.

:class:`Updater` turns the window's reduced gradients into updated parameters (norm, clip,
non-finite check, the optimizer's step, the masters published into the module);
:class:`StepBook` keeps the counters, the skip verdict and the LR schedule. ``ZeroEngine.step``
reads them in this order:

1. :meth:`StepBook.settle` — the previous step's deferred verdict takes its host-side effects
   (skip count and log line; the schedule step of an applied update);
2. :meth:`Updater.apply` runs the update; its verdict is either decided on the device
   (:meth:`StepBook.defer`: the optimizer skipped or applied it itself, the host learns which
   at the next settle) or read on the host before the update (:meth:`StepBook.decide`:
   offload, or an optimizer without ``found_inf`` support);
3. :meth:`StepBook.close` — the schedule steps for an applied update, and the counters move.

The LR schedule advances in :meth:`StepBook.settle` and :meth:`StepBook.close` only, once per
applied update (DeepSpeed does not advance it on a skipped step); reading a counter or
``skipped_steps`` changes nothing. Outside the step, ``get_lr()``, a log line and a checkpoint
settle first, so that what they report includes the last step. See [Note: skipping a step
without a host sync] in :mod:`ds_core.zero.precision` for how the verdict reaches the host.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_core.accelerator import Accelerator
from ds_core.zero.partition import FlatUnit, Mode, ZeroParam
from ds_core.zero.precision import (
    LossScaler,
    NonFiniteGradientsError,
    step_skips_on_device,
    step_with_found_inf,
)
from ds_core.zero.published import PublishedGathers

if TYPE_CHECKING:
    from ds_core.comm import Mesh
    from ds_core.zero.offload.host import OptimizerOffload
    from ds_core.zero.offload.nvme_param import ParamSwapper
    from ds_core.zero.reducer import GradReducer

__all__ = ["SkipTracker", "StepBook", "Updater", "Verdict"]

log = logging.getLogger("ds_core.zero")


class Verdict(enum.Enum):
    """What became of one optimizer step's update."""

    #: the update reached the parameters and the optimizer state.
    APPLIED = "applied"
    #: non-finite gradients: parameters, optimizer state and schedule untouched.
    SKIPPED = "skipped"
    #: decided on the device; the host reads it at the next :meth:`StepBook.settle`.
    DEFERRED = "deferred"


class SkipTracker:
    """Brings each step's non-finite verdict to the host one step late (see [Note: skipping a
    step without a host sync]) and counts the skips.

    :param acc: the accelerator (pinned memory, events).
    :param max_consecutive: consecutive skips after which :meth:`settle` raises; 0 never.
    :param scaler: the fp16 loss scaler, whose calibration skips do not count towards the
        limit until the scale sits at its minimum.
    """

    def __init__(self, acc: Accelerator, max_consecutive: int, scaler: LossScaler | None) -> None:
        self.acc = acc
        self.max_consecutive = max_consecutive
        self.scaler = scaler
        self._pinned = "pinned_memory" in acc.capabilities
        flag = torch.zeros((), dtype=torch.bool)
        #: where the verdict lands on the host; a read of it never waits for the device.
        self.host_flag = acc.pin_memory(flag) if self._pinned else flag
        self._arrived: Any = None
        self._device_flag: torch.Tensor | None = None
        self._pending_step: int | None = None
        #: updates skipped so far (settled ones).
        self.skipped = 0
        self._consecutive: list[int] = []

    @property
    def pending(self) -> bool:
        """Whether a step's verdict has not been read yet."""
        return self._pending_step is not None

    def record(self, found_inf: torch.Tensor, step: int) -> None:
        """Start bringing step ``step``'s verdict (a 0-dim bool tensor) to the host."""
        if self._pinned or self.acc.is_synchronized_device():
            self.host_flag.copy_(found_inf, non_blocking=self._pinned)
            self._device_flag = None
        else:  # a pageable copy would wait for the step: read the device flag at settle
            self._device_flag = found_inf
        self._arrived = self.acc.Event()
        self._arrived.record()
        self._pending_step = step

    def _read(self) -> bool:
        """The pending verdict's flag (waits for it only if it has not arrived)."""
        # Polling first: the verdict is a step old and normally arrived, and a synchronize
        # is a host sync even then. Only a device a whole step behind makes the host wait.
        if not self._arrived.query():
            self._arrived.synchronize()
        flag = self._device_flag if self._device_flag is not None else self.host_flag
        return bool(flag)

    def skipped_so_far(self) -> int:
        """Settled skips plus the pending step's, if it was skipped; changes nothing."""
        return self.skipped + (1 if self.pending and self._read() else 0)

    def settle(self) -> Verdict | None:
        """Read the pending verdict (``None``: nothing pending) and log a skip with its step.

        :raises NonFiniteGradientsError: the skip made ``max_consecutive`` in a row.
        """
        step = self._pending_step
        if step is None:
            return None
        skipped = self._read()
        self._pending_step, self._device_flag = None, None
        if not skipped:
            self._consecutive.clear()
            return Verdict.APPLIED
        self.skipped += 1
        scaler = self.scaler
        if scaler is not None and not scaler.at_minimum():  # the scale still calibrates
            log.info("step %d skipped: fp16 overflow, loss scale now %g", step, scaler.scale)
            self._consecutive.clear()
            return Verdict.SKIPPED
        log.warning("step %d skipped: non-finite gradient (inf or NaN)", step)
        self._consecutive.append(step)
        if self.max_consecutive and len(self._consecutive) >= self.max_consecutive:
            first, last = self._consecutive[0], self._consecutive[-1]
            raise NonFiniteGradientsError(
                f"{len(self._consecutive)} consecutive steps ({first}–{last}) had non-finite "
                "gradients and were skipped; training stops. Check the data and the loss for "
                "inf/NaN, lower the learning rate, or raise "
                "nonfinite_gradients.max_consecutive_skips (0 never stops)"
            )
        return Verdict.SKIPPED

    def restore(self, skipped: int) -> None:
        """Set the settled count (a checkpoint load); a pending verdict belonged to the state
        the load replaces and is dropped."""
        self._pending_step, self._device_flag = None, None
        self._consecutive.clear()
        self.skipped = int(skipped)


class StepBook:
    """One engine's step bookkeeping (see the module docstring for the order).

    :param skips: the verdict transport.
    :param scheduler: returns the engine's LR scheduler (or ``None``) when it must step; read
        each time, since a trainer may replace ``engine.lr_scheduler``.
    :param samples_per_step: samples over all ranks per optimizer step (``train_batch_size``).
    """

    def __init__(
        self, skips: SkipTracker, scheduler: Callable[[], Any], samples_per_step: int
    ) -> None:
        self.skips = skips
        self._scheduler = scheduler
        self.samples_per_step = samples_per_step
        #: optimizer steps taken (boundaries seen, skipped ones included).
        self.global_steps = 0
        #: samples seen over all ranks.
        self.global_samples = 0
        #: ``step()`` calls (micro-batches).
        self.micro_steps = 0

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for non-finite gradients, the last step's included."""
        return self.skips.skipped_so_far()

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.skips.restore(value)

    def settle(self) -> None:
        """Take the host-side effects of a deferred verdict, if one is pending."""
        if self.skips.settle() is Verdict.APPLIED:
            self._advance_schedule()

    def defer(self, found_inf: torch.Tensor, step: int) -> Verdict:
        """The device decided step ``step`` (``found_inf``: 0-dim bool); the host reads it at
        the next :meth:`settle`."""
        self.skips.record(found_inf, step)
        return Verdict.DEFERRED

    def record(self, found_inf: torch.Tensor, step: int) -> None:
        """Start bringing step ``step``'s verdict to the host for :meth:`verdict` (with other
        copies, before one wait)."""
        self.skips.record(found_inf, step)

    def verdict(self) -> Verdict:
        """The recorded verdict, read now (before the update that depends on it)."""
        verdict = self.skips.settle()
        if verdict is None:
            raise RuntimeError("StepBook.verdict(): no verdict was recorded for this step")
        return verdict

    def decide(self, found_inf: torch.Tensor, step: int) -> Verdict:
        """:meth:`record` and :meth:`verdict` in one."""
        self.record(found_inf, step)
        return self.verdict()

    def close(self, verdict: Verdict) -> None:
        """End an optimizer step: the schedule steps for an applied update (a deferred one
        steps when settled), and the counters move."""
        if verdict is Verdict.APPLIED:
            self._advance_schedule()
        self.global_steps += 1
        self.global_samples += self.samples_per_step

    def _advance_schedule(self) -> None:
        scheduler = self._scheduler()
        if scheduler is not None:
            scheduler.step()


class Updater:
    """One engine's update at the boundary: the reduced gradients become parameters.

    Sums over ranks become means and the fp16 loss scale comes off in one multiply; the global
    norm, the clip coefficient and the non-finite flag stay on the device (the host reads the
    flag only when the optimizer cannot skip on the device, see [Note: skipping a step without
    a host sync]). With optimizer offload the step runs on the host (see [Note: offload data
    path]). After the optimizer's step the masters are published into the module's parameters.

    :param acc: the accelerator (the all-reduce of a local overflow flag).
    :param reducer: the engine's gradient path, holding the window's gradients.
    :param book: the engine's step bookkeeping, which takes the verdict.
    :param optimizer: returns the engine's optimizer (read at each step, as the engine's).
    :param mesh: the engine's mesh (data-parallel group, pipeline stages).
    :param world: ranks in the world.
    :param trainable: the trainable parameters, whose masters the optimizer steps.
    :param gathered: the stage-1/2 units all-gathered after each update.
    :param loss_scaler: the fp16 loss scaler, or ``None``.
    :param offload: the host side of optimizer offload, or ``None``.
    :param param_swap: NVMe parameter offload's swapper, or ``None``.
    :param clip: ``gradient_clipping`` (0: none).
    :param check_overflow: whether a step with inf/NaN gradients is skipped.
    :param norm_dtype: dtype of the global norm's accumulation.
    :param overlap_comm: keep two all-gathers in flight when publishing.
    :param after_reduction: run once the gradients are reduced, before the norm (the
        engine's list; a pipeline appends to it after construction).
    :param module: the engine's module: with ``overlap_comm`` the all-gathers of ``gathered``
        are left in flight for its next forward (see [Note: deferred after-step gathers]).
    """

    def __init__(
        self,
        acc: Accelerator,
        reducer: GradReducer,
        book: StepBook,
        optimizer: Callable[[], Any],
        mesh: Mesh,
        world: int,
        trainable: list[ZeroParam],
        gathered: list[FlatUnit],
        *,
        loss_scaler: LossScaler | None,
        offload: OptimizerOffload | None,
        param_swap: ParamSwapper | None,
        clip: float,
        check_overflow: bool,
        norm_dtype: torch.dtype,
        overlap_comm: bool,
        after_reduction: list[Callable[[], None]],
        module: nn.Module | None = None,
    ) -> None:
        self.acc = acc
        self.reducer = reducer
        self.book = book
        self._optimizer = optimizer
        self.mesh = mesh
        self.world = world
        self.trainable = trainable
        self.gathered = gathered
        self.loss_scaler = loss_scaler
        self.offload = offload
        self.param_swap = param_swap
        self.clip = clip
        self.check_overflow = check_overflow
        self.norm_dtype = norm_dtype
        self.overlap_comm = overlap_comm
        self.after_reduction = after_reduction
        #: with ``overlap_comm``, the after-step all-gathers the next forward waits for.
        self.published = (
            PublishedGathers(module, gathered)
            if module is not None and overlap_comm and gathered
            else None
        )
        #: the last step's global norm (unscaled, before clipping), on the device, or ``None``.
        self.last_norm: torch.Tensor | None = None
        opt = optimizer()
        #: a non-finite step is skipped inside the optimizer, on the device; otherwise
        #: (offload, or an optimizer without ``found_inf``) the host reads the verdict.
        self.skips_on_device = offload is None and step_skips_on_device(opt)
        if check_overflow and opt is not None and not self.skips_on_device:
            log.info(
                "%s: the non-finite check reads one flag on the host per step (%s)",
                type(opt).__name__,
                "optimizer offload steps on the host"
                if offload is not None
                else "its step() does not accept found_inf; torch's fused=True optimizers do",
            )

    def apply(self) -> Verdict:
        """Finish the window's reduction and update (or skip); return the verdict for
        :meth:`StepBook.close`. Collective: every rank calls it at the same boundary."""
        reducer = self.reducer
        reducer.finish()
        reducer.check_every_gradient_arrived()
        for fn in self.after_reduction:
            fn()
        scale = self.loss_scaler.scale_tensor if self.loss_scaler is not None else 1.0
        # Sums over ranks become means; the loss scale comes off in the same multiply.
        coef = reducer.post_scale / scale
        norm: torch.Tensor | None = None
        if self.clip > 0 or self.check_overflow:
            norm = reducer.global_norm(self.norm_dtype) * coef
        self.last_norm = norm
        mult = coef
        if self.clip > 0 and norm is not None:
            # torch's clip_grad_norm_ coefficient, kept on the device.
            mult = ((self.clip / (norm + 1e-6)).clamp(max=1.0) * coef).to(torch.float32)
        found_inf = None if norm is None or not self.check_overflow else ~norm.isfinite()
        if found_inf is not None and not reducer.communicate and self.world > 1:
            # Local gradients: every rank must skip together, or the optimizer's own
            # collectives would not match (DeepSpeed's CheckOverflow does the same).
            any_inf = found_inf.to(torch.float32)
            group = self.mesh.dp_group if self.mesh.pp_size == 1 else None  # every stage too
            self.acc.all_reduce(any_inf, "sum", group)
            found_inf = any_inf > 0
        step = self.book.global_steps + 1
        if found_inf is None:
            verdict = Verdict.APPLIED
            self._update(mult)
        elif self.skips_on_device:
            self._update(mult, found_inf.to(torch.float32))
            verdict = self.book.defer(found_inf, step)
        elif self.offload is not None:
            # Offload steps on the host: the verdict lands with the gradients, in one wait.
            flag = found_inf
            host_mult = self._offload_land(mult, lambda: self.book.record(flag, step))
            verdict = self.book.verdict()
            if verdict is Verdict.APPLIED:
                self._offload_step(host_mult)
        else:
            # An optimizer without ``found_inf`` support: the host needs the flag now.
            verdict = self.book.decide(found_inf, step)
            if verdict is Verdict.APPLIED:
                self._update(mult)
        if self.loss_scaler is not None and found_inf is not None:
            self.loss_scaler.update(found_inf)
        return verdict

    def _update(self, mult: float | torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
        """Scale the reduced gradients by ``mult``, step the optimizer (a no-op on the device
        where ``found_inf`` is 1) and publish the masters into the parameters."""
        if self.offload is not None:
            self._offload_step(self._offload_land(mult))
            return
        self.reducer.scale_(mult)
        for zp in self.trainable:
            if zp.master is not None:
                zp.master.grad = self.reducer.grad(zp)
        if found_inf is None:
            self._optimizer().step()
        else:
            step_with_found_inf(self._optimizer(), found_inf)
        self.publish()

    def _offload_land(
        self, mult: float | torch.Tensor, verdict: Callable[[], None] | None = None
    ) -> float | None:
        """Bring the window's gradients, the multiplier and ``verdict`` to the host in one
        wait (see [Note: offload data path]); return the multiplier the host step applies
        (``None``: already applied on the device)."""
        assert self.offload is not None
        fused = self.offload.uses_fused_scale(self._optimizer())
        on_host = self.reducer.host is not None  # the window was summed on the host already
        if not fused and not on_host:
            self.reducer.scale_(mult)  # on the device, before the copy
        host_mult = self.offload.gradients_to_host(self.reducer.reduced_ranges(), mult, verdict)
        return host_mult if fused or on_host else None

    def _offload_step(self, host_mult: float | None) -> None:
        """The optimizer step with masters on the host, after :meth:`_offload_land`."""
        assert self.offload is not None
        self.offload.step(self._optimizer(), host_mult)
        self.publish()

    def close(self) -> None:
        """Wait for the gathers still in flight and remove the forward hooks (teardown)."""
        if self.published is not None:
            self.published.remove()

    def publish(self) -> None:
        """Move updated masters into the parameters the module computes with: each rank
        writes its own range, then one all-gather per stage-1/2 unit rebuilds the rest."""
        with torch.no_grad():
            if self.published is not None:
                self.published.drain()  # the ranges below are what those gathers read
            if self.offload is not None:
                self.offload.publish()
            for zp in self.trainable:
                master = zp.master
                if master is None or (self.offload is not None and self.offload.holds(zp.unit)):
                    continue
                if zp.mode is Mode.REPLICATED:
                    if master is not zp.param:
                        zp.param.data.copy_(master.detach())
                    continue
                assert zp.unit is not None
                zp.unit.write_owned(zp, master.detach())
            if self.published is not None:
                # left in flight: the next forward waits per module (see [Note: deferred
                # after-step gathers])
                self.published.issue()
                pending = []
            else:
                pending = FlatUnit.all_gather_each(self.gathered, self.overlap_comm)
            if self.param_swap is not None:
                self.param_swap.flush()  # updated shards to their files, asynchronously
            for h in pending:
                h.wait()
