"""Loss scaling for fp16 training (static or dynamic), DeepSpeed's algorithm.

Dynamic scaling starts at ``2 ** initial_scale_power``. An overflowing step is skipped; when the
hysteresis budget is used up the scale halves (never below ``min_loss_scale``), otherwise the
budget shrinks by one. After every ``loss_scale_window`` steps since the last overflow the scale
doubles and the budget refills.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ds_core.zero")


class LossScaler:
    """The loss scale and its update rule.

    :param loss_scale: a fixed scale; 0 means dynamic.
    :param initial_scale_power: dynamic scale starts at ``2**initial_scale_power``.
    :param loss_scale_window: clean steps between doublings (> 0).
    :param hysteresis: overflows tolerated before the scale halves (≥ 1).
    :param min_loss_scale: the floor of the dynamic scale (> 0).
    """

    def __init__(
        self,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
    ) -> None:
        self.dynamic = loss_scale == 0
        self.scale = float(2**initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.min_scale = min_loss_scale
        self.iteration = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16: Any) -> LossScaler:
        """Build from an ``FP16Config`` (``.loss_scale``, ``.initial_scale_power``, ...)."""
        return cls(
            fp16.loss_scale,
            fp16.initial_scale_power,
            fp16.loss_scale_window,
            fp16.hysteresis,
            fp16.min_loss_scale,
        )

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; ``overflow`` says whether its gradients were non-finite."""
        if self.dynamic:
            if overflow:
                if self.cur_hysteresis <= 1:
                    if self.scale <= self.min_scale:
                        log.warning("fp16 overflow at the minimum loss scale %g", self.scale)
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.iteration
            elif (self.iteration - self.last_overflow_iter) % self.window == 0:
                self.scale *= 2.0
                self.cur_hysteresis = self.hysteresis
        self.iteration += 1

    def state_dict(self) -> dict[str, float | int | bool]:
        """Everything needed to resume exactly."""
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "iteration": self.iteration,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
