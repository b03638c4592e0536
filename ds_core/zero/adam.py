"""Adam without bias correction: DeepSpeed's ``optimizer.params.bias_correction: false``.

torch's Adam/AdamW always correct the moments' bias; DeepSpeed's FusedAdam makes it optional.
With it off, the update is ``lr * m / (sqrt(v) + eps)`` on the raw moments, weight decay
decoupled (``adam_w_mode``, DeepSpeed's default) or added to the gradient (L2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["AdamNoBiasCorrection"]


class AdamNoBiasCorrection(torch.optim.Optimizer):
    """Adam on uncorrected moments (FusedAdam with ``bias_correction=False``).

    :param params: parameters or parameter groups.
    :param lr: learning rate.
    :param betas: moment decay rates, each in [0, 1).
    :param eps: added to ``sqrt(v)``.
    :param weight_decay: decay coefficient.
    :param adam_w_mode: decoupled weight decay (``p *= 1 - lr * wd``) if true, else L2.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if wd != 0 and not group["adam_w_mode"]:
                    grad = grad.add(p, alpha=wd)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if wd != 0 and group["adam_w_mode"]:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
        return loss
