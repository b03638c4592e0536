"""engine.tput_timer: DeepSpeed's ThroughputTimer arithmetic, on a scripted clock."""

from __future__ import annotations

import logging

import pytest

from ds_core.zero.compat import throughput
from ds_core.zero.compat.throughput import ThroughputTimer


def test_samples_per_second_over_counted_windows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = iter([10.0, 10.5, 20.0, 21.0, 30.0, 32.0])  # start/stop pairs of windows 2-4
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    timer = ThroughputTimer(batch_size=8, start_step=1, steps_per_output=3)
    assert timer.avg_samples_per_sec() == float("-inf")
    with caplog.at_level(logging.INFO, logger="ds_core.zero"):
        for _window in range(4):
            for micro in range(2):  # two micro-batches per optimizer step
                timer.start()
                timer.stop(global_step=micro == 1)
    # window 1 is warm-up; windows 2-4 took 0.5 + 1 + 2 s for 3 x 8 samples
    assert timer.global_step_count == 4 and timer.micro_step_count == 8
    assert timer.total_elapsed_time == pytest.approx(3.5)
    assert timer.avg_samples_per_sec() == pytest.approx(24 / 3.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["global_step=3 RunningAvgSamplesPerSec=10.6667 CurrSamplesPerSec=8"]
