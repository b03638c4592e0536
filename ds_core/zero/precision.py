"""Loss scaling and the skip of non-finite updates, both kept on the device.

[Note: skipping a step without a host sync]
A step whose gradients hold inf/NaN must not reach the parameters or the optimizer state. The
verdict (``found_inf``, from the global norm the step computes anyway) stays on the device:
the optimizer receives it the way torch's GradScaler hands it over (``optimizer.found_inf``;
torch's fused Adam/AdamW/SGD then leave parameters, moments and step count untouched), and
the dynamic loss scale is updated from it with tensor ops. Only host-side decisions need the
verdict on the host — the learning-rate schedule (DeepSpeed does not advance it on a skipped
step), the skip counter and its log line — and they can wait:
:class:`~ds_core.zero.steps.SkipTracker` copies the flag into a host buffer (pinned and
non-blocking where the backend has pinned memory) and reads it at the next step, when the
device finished it long ago, or earlier when the user asks (``skipped_steps``, ``get_lr()``, a
log line, a checkpoint); :class:`~ds_core.zero.steps.StepBook` takes the host-side effects.

Dynamic scaling is DeepSpeed's: it starts at ``2 ** initial_scale_power``; an overflowing step
is skipped; when the hysteresis budget is used up the scale halves (never below
``min_loss_scale``), otherwise the budget shrinks by one; after every ``loss_scale_window``
steps since the last overflow the scale doubles and the budget refills.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LossScaler", "NonFiniteGradientsError", "step_skips_on_device", "step_with_found_inf"]


class NonFiniteGradientsError(RuntimeError):
    """Too many consecutive updates were skipped for non-finite gradients."""


def step_skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` honours ``optimizer.found_inf`` on the device (torch marks
    such optimizers, its fused Adam/AdamW/SGD, with ``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_with_found_inf(optimizer: Any, found_inf: torch.Tensor) -> None:
    """Run ``optimizer.step()`` with the GradScaler hand-over: ``found_inf`` (float32 0/1 on
    the parameters' device) makes it a no-op on the device; gradients are already unscaled."""
    optimizer.grad_scale = None
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf


class LossScaler:
    """The fp16 loss scale and its update rule, resident on ``device``.

    :param loss_scale: a fixed scale; 0 means dynamic.
    :param initial_scale_power: dynamic scale starts at ``2**initial_scale_power``.
    :param loss_scale_window: clean steps between doublings (> 0).
    :param hysteresis: overflows tolerated before the scale halves (≥ 1).
    :param min_loss_scale: the floor of the dynamic scale (> 0).
    :param device: where the scale lives (the device the loss is computed on).
    """

    def __init__(
        self,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
        device: torch.device | str | None = None,
    ) -> None:
        self.dynamic = loss_scale == 0
        start = float(2**initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = min_loss_scale
        #: the scale the loss is multiplied by (float32, on the device).
        self.scale_tensor = torch.tensor(start, dtype=torch.float32, device=device)
        self._hysteresis = torch.tensor(hysteresis, dtype=torch.int64, device=device)
        self._last_overflow = torch.tensor(-1, dtype=torch.int64, device=device)
        #: optimizer steps seen, skipped ones included (host: it advances unconditionally).
        self.iteration = 0

    @classmethod
    def from_config(cls, fp16: Any, device: torch.device | str | None = None) -> LossScaler:
        """Build from an ``FP16Config`` (``.loss_scale``, ``.initial_scale_power``, ...)."""
        return cls(
            fp16.loss_scale,
            fp16.initial_scale_power,
            fp16.loss_scale_window,
            fp16.hysteresis,
            fp16.min_loss_scale,
            device,
        )

    @property
    def scale(self) -> float:
        """The current scale (reads the device)."""
        return float(self.scale_tensor.item())

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor) -> None:
        """Advance one optimizer step on the device; ``found_inf`` (a 0-dim bool tensor) says
        whether its gradients were non-finite. No host read."""
        if self.dynamic:
            halve = found_inf & (self._hysteresis <= 1)
            since = torch.remainder(self.iteration - self._last_overflow, self.window)
            grow = ~found_inf & (since == 0)
            s = self.scale_tensor
            s.copy_(
                torch.where(
                    halve, (s * 0.5).clamp(min=self.min_scale), torch.where(grow, s * 2.0, s)
                )
            )
            h = self._hysteresis
            h.copy_(
                torch.where(
                    found_inf & ~halve,
                    h - 1,
                    torch.where(grow, torch.full_like(h, self.hysteresis), h),
                )
            )
            self._last_overflow.copy_(
                torch.where(found_inf, torch.full_like(h, self.iteration), self._last_overflow)
            )
        self.iteration += 1

    def at_minimum(self) -> bool:
        """Whether the dynamic scale sits at ``min_loss_scale`` (reads the device)."""
        return self.dynamic and self.scale <= self.min_scale

    def state_dict(self) -> dict[str, float | int | bool]:
        """Everything needed to resume exactly (reads the device)."""
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "cur_hysteresis": int(self._hysteresis.item()),
            "iteration": self.iteration,
            "last_overflow_iter": int(self._last_overflow.item()),
        }

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        """Restore :meth:`state_dict`."""
        self.scale_tensor.fill_(float(state["scale"]))
        self._hysteresis.fill_(int(state["cur_hysteresis"]))
        self.iteration = int(state["iteration"])
        self._last_overflow.fill_(int(state["last_overflow_iter"]))
