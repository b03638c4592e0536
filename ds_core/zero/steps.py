"""The step's bookkeeping in one place: the counters, the skip verdict and the LR schedule.

An optimizer step (``ZeroEngine._boundary_step``) reads its :class:`StepBook` in this order:

1. :meth:`StepBook.settle` — the previous step's deferred verdict takes its host-side effects
   (skip count and log line; the schedule step of an applied update);
2. the update runs; its verdict is either decided on the device (:meth:`StepBook.defer`: the
   optimizer skipped or applied it itself, the host learns which at the next settle) or read
   on the host before the update (:meth:`StepBook.decide`: offload, or an optimizer without
   ``found_inf`` support);
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
from typing import Any

import torch

from ds_core.accelerator import Accelerator
from ds_core.zero.precision import LossScaler, NonFiniteGradientsError

__all__ = ["SkipTracker", "StepBook", "Verdict"]

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
