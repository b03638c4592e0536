"""``engine.tput_timer``: DeepSpeed's ``ThroughputTimer`` (samples per second over steps).

The engine starts it at each forward and stops it at each ``step()``; a step window's time is
host wall time from its first forward to the ``step()`` that ends it, summed over windows
after ``start_step`` (DeepSpeed skips the first two, which include warm-up). Unlike
DeepSpeed's it does not synchronise the device at every start and stop (ds_core keeps host
reads out of the step): on an asynchronous device a window's time is when the host got
through it, which over many steps paces the device (the host waits once its queue is full),
but a single window can read short. Pass ``synchronize=True`` for DeepSpeed's exact timing at
the cost of two device synchronisations per micro-batch.
"""

from __future__ import annotations

import logging
import time

from ds_core.accelerator import get_accelerator

__all__ = ["ThroughputTimer"]

log = logging.getLogger("ds_core.zero")


class ThroughputTimer:
    """Samples per second of the training loop.

    :param batch_size: samples per optimizer step over all ranks (``train_batch_size``).
    :param start_step: optimizer steps not counted (warm-up).
    :param steps_per_output: log the rates every this many optimizer steps (0: never).
    :param synchronize: synchronise the device at every start and stop (DeepSpeed's timing).
    """

    def __init__(
        self,
        batch_size: int,
        start_step: int = 2,
        steps_per_output: int = 0,
        synchronize: bool = False,
    ) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.synchronize = synchronize
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        #: seconds of the counted windows, and of the current window so far.
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._start: float | None = None

    def _now(self) -> float:
        if self.synchronize:
            get_accelerator().synchronize()
        return time.perf_counter()

    def start(self) -> None:
        """Start timing (a forward); no-op while already started or during warm-up."""
        if self._start is None and self.global_step_count >= self.start_step:
            self._start = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Stop timing (a ``step()``); ``global_step``: the step updated the parameters."""
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self._start is not None and global_step:
            duration = self._now() - self._start
            self._start = None
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if (
                report_speed
                and self.steps_per_output
                and self.global_step_count % self.steps_per_output == 0
            ):
                log.info(
                    "global_step=%d RunningAvgSamplesPerSec=%.6g CurrSamplesPerSec=%.6g",
                    self.global_step_count,
                    self.avg_samples_per_sec(),
                    self.batch_size / self.step_elapsed_time,
                )
            self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """An epoch ended (DeepSpeed's name, called by training loops such as DeepSpeed-Chat's):
        ``epoch_count`` counts it and ``micro_step_count`` starts again from 0."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the counted steps; ``-inf`` before any (DeepSpeed's)."""
        counted = self.global_step_count - self.start_step
        if counted <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * counted / self.total_elapsed_time
