"""``deepspeed.runtime.lr_schedules``'s names: ``from ds_core.runtime.lr_schedules import
WarmupLR`` works as with DeepSpeed. ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and
``LRRangeTest`` are :mod:`ds_core.zero.compat.builders`'s (the config's ``scheduler`` section
builds them); ``OneCycle`` is here, for scripts that build it themselves (the config's
``scheduler`` section does not take it).
"""

from __future__ import annotations

import logging
import math

import torch

from ds_core.zero.compat.builders import (
    LRRangeTest,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    _DeepSpeedSchedule,
    _per_group,
)

__all__ = [
    "COS_MIN_RATIO",
    "CYCLE_FIRST_STAIR_COUNT",
    "CYCLE_FIRST_STEP_SIZE",
    "CYCLE_MAX_LR",
    "CYCLE_MAX_MOM",
    "CYCLE_MIN_LR",
    "CYCLE_MIN_MOM",
    "CYCLE_SECOND_STAIR_COUNT",
    "CYCLE_SECOND_STEP_SIZE",
    "DECAY_LR_RATE",
    "DECAY_MOM_RATE",
    "DECAY_STEP_SIZE",
    "EDGE_VALUE",
    "LR_RANGE_TEST",
    "LR_RANGE_TEST_MIN_LR",
    "LR_RANGE_TEST_STAIRCASE",
    "LR_RANGE_TEST_STEP_RATE",
    "LR_RANGE_TEST_STEP_SIZE",
    "LR_SCHEDULE",
    "MID_VALUE",
    "ONE_CYCLE",
    "TOTAL_NUM_STEPS",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "WARMUP_MAX_LR",
    "WARMUP_MIN_LR",
    "WARMUP_MIN_RATIO",
    "WARMUP_NUM_STEPS",
    "WARMUP_TYPE",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]

log = logging.getLogger("ds_core.runtime")

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
#: DeepSpeed's schedule names, all importable from here.
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

#: DeepSpeed's names for the schedules' parameter keys and warm-up types (its
#: ``deepspeed/runtime/lr_schedules.py`` constants), for code that builds ``scheduler`` params
#: with them (DeepSpeed's own unit tests do).
COS_MIN_RATIO = "cos_min_ratio"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_MAX_LR = "cycle_max_lr"
CYCLE_MAX_MOM = "cycle_max_mom"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
DECAY_LR_RATE = "decay_lr_rate"
DECAY_MOM_RATE = "decay_mom_rate"
DECAY_STEP_SIZE = "decay_step_size"
EDGE_VALUE = "edge_value"
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_SCHEDULE = "lr_schedule"
MID_VALUE = "mid_value"
TOTAL_NUM_STEPS = "total_num_steps"
WARMUP_LINEAR_RATE = "linear"
WARMUP_LOG_RATE = "log"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MIN_RATIO = "warmup_min_ratio"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"

#: the second Adam beta OneCycle sets while it cycles the first (DeepSpeed's constant).
_BETA2 = 0.99


class OneCycle(_DeepSpeedSchedule):
    """DeepSpeed's ``OneCycle``: lr (and Adam's first beta) over one cycle, then decay.

    With ``F`` = ``cycle_first_step_size``, ``S`` = ``cycle_second_step_size`` (default ``F``)
    and ``b = i + 1`` for DeepSpeed iteration ``i``: the cycle's scale rises linearly from 0 to
    1 over ``F`` iterations and falls back over ``S`` (in ``stair_count`` steps when that is
    positive); ``lr = min + (max − min) · scale`` and ``beta1 = max_mom − (max_mom − min_mom) ·
    scale``. After the cycle (``i ≥ F + S``), with ``d = i − F − S + 1``,
    ``lr = min / (1 + decay_lr_rate · d / decay_step_size)`` and ``beta1 = max_mom · (1 +
    decay_mom_rate · d / decay_step_size)``; a zero ``decay_step_size`` or rate keeps ``min`` /
    ``max_mom``. While momentum cycles, betas are ``(beta1, 0.99)``, as in DeepSpeed; an
    optimizer without ``betas`` cycles no momentum (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.warning(
                "cycle_momentum is disabled because optimizer %s has no betas in its defaults",
                type(optimizer).__name__,
            )
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.min_moms = [(m, _BETA2) for m in _per_group(cycle_min_mom, n, "cycle_min_mom")]
        self.max_moms = [(m, _BETA2) for m in _per_group(cycle_max_mom, n, "cycle_max_mom")]
        self._moms_live = False  # the base class's first step() leaves betas alone
        super().__init__(optimizer, last_batch_iteration)
        self._moms_live = True
        if self.cycle_momentum:
            moms = (
                self.min_moms if last_batch_iteration == -1 else self.mom_at(last_batch_iteration)
            )
            for group, betas in zip(optimizer.param_groups, moms, strict=True):
                group["betas"] = betas

    def _scale(self, it: int) -> float:
        b = it + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = b % self.total_size
            if pos <= self.first_step_size:
                stair = pos * stairs / self.first_step_size
            else:
                stair = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def lr_at(self, it: int) -> list[float]:
        if it < self.total_size:
            scale = self._scale(it)
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (it - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def mom_at(self, it: int) -> list[tuple[float, float]]:
        """``betas`` per group at DeepSpeed iteration ``it``."""
        if it < self.total_size:
            scale = self._scale(it)
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (it - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """DeepSpeed's: the betas for the current iteration, or ``None`` without momentum."""
        return self.mom_at(self.last_batch_iteration) if self.cycle_momentum else None

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum and self._moms_live:
            for group, betas in zip(
                self.optimizer.param_groups, self.mom_at(self.last_batch_iteration), strict=True
            ):
                group["betas"] = betas
