"""LAMB: DeepSpeed's ``FusedLamb`` (what ``{"optimizer": {"type": "Lamb"}}`` builds) in plain torch.

The formulas are those of DeepSpeed's ``deepspeed/ops/lamb/fused_lamb.py`` and its CUDA kernel
``csrc/lamb/fused_lamb_cuda_kernel.cu`` (driven by ``csrc/lamb/fused_lamb_cuda.cpp``). Per
parameter ``p`` with gradient ``g``, at step ``t`` (counted from 1, per parameter):

- ``m = b1 m + (1 - b1) g`` and ``v = b2 v + (1 - b2) g²`` (the moments are stored uncorrected).
- ``denom = sqrt(v) + eps``, or ``sqrt(v + eps)`` with ``eps_inside_sqrt``.
- ``u = m / denom + weight_decay * p``: weight decay joins the update (so it is measured by the
  trust ratio), not the gradient, and not the moments.
- ``w = ||p||``, ``n = ||u||`` (L2 over the whole tensor, ``p`` before this step's change).
  The coefficient is ``1`` when ``w == 0`` or ``n == 0``, else ``w / n`` capped at ``max_coeff``
  and then raised to ``min_coeff`` (in that order: with ``min_coeff > max_coeff`` the
  coefficient is ``min_coeff``, as in the kernel).
- ``step_size = lr * sqrt(1 - b2**t) / (1 - b1**t)`` with ``bias_correction``, else ``lr``:
  the bias correction scales the step; it does not enter ``denom``, so ``eps`` acts on the
  uncorrected ``v``.
- ``p -= step_size * coefficient * u``.

Deliberate differences from DeepSpeed:

- Any device and dtype: the arithmetic runs on the tensors' own device in the parameter's dtype
  (the norms accumulate in float32 for 16-bit parameters, as the kernel's accumulator does).
  ``step()`` never synchronises with the host: the coefficient stays a device tensor.
- ``amsgrad=True`` raises :class:`ValueError` (DeepSpeed raises ``RuntimeError``).
- ``max_grad_norm > 0`` raises :class:`ValueError` at construction. DeepSpeed only honours it
  when the caller passes per-group gradient norms to ``step(..., grad_norms=...)`` (the legacy
  fused fp16 path); a plain ``step()``, which is what its engine calls today, fails on it with a
  ``TypeError``. Clip with the engine's ``gradient_clipping`` instead. Likewise the extra
  ``step()`` arguments ``grads``, ``output_params`` and ``scale`` (a divisor of the gradient,
  ``1`` by default) are not offered: ``step()`` behaves as DeepSpeed's with its defaults.
- ``lr``, ``eps`` and ``betas`` are range-checked (DeepSpeed checks nothing).

As in DeepSpeed, ``eps_inside_sqrt`` is an attribute of the optimizer, not of the parameter
groups, so it is not part of ``state_dict()``; everything a step reads per parameter (``step``,
``exp_avg``, ``exp_avg_sq``) is, so a run resumed from ``state_dict()`` continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_core.optim._checks import check_common

__all__ = ["Lamb"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's ``FusedLamb`` (the module docstring gives the update).

    :param params: parameters or parameter groups, on any device.
    :param lr: learning rate (units of the parameters per unit update); >= 0.
    :param bias_correction: scale the step by ``sqrt(1 - b2**t) / (1 - b1**t)``.
    :param betas: ``(b1, b2)``, the moments' decay rates per step, each in [0, 1).
    :param eps: added to ``sqrt(v)``, or to ``v`` under the root with ``eps_inside_sqrt``; >= 0.
    :param eps_inside_sqrt: denominator ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
    :param weight_decay: coefficient of ``p`` added to the update before the trust ratio.
    :param max_grad_norm: must be ``<= 0`` (off); see the module docstring.
    :param max_coeff: upper bound of the trust ratio (dimensionless).
    :param min_coeff: lower bound of the trust ratio, applied after ``max_coeff``.
    :param amsgrad: must be false; DeepSpeed's LAMB has no AMSGrad variant.
    :raises ValueError: ``amsgrad`` true, ``max_grad_norm > 0``, or ``lr``, ``eps`` or ``betas``
        out of range; the message names the argument.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        check_common("Lamb", lr, betas, eps, 0.0, amsgrad)
        if max_grad_norm > 0:
            raise ValueError(
                f"Lamb: max_grad_norm={max_grad_norm} is not supported; DeepSpeed's FusedLamb "
                "only applies it with gradient norms passed to step(). Use the engine's "
                "gradient_clipping instead"
            )
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "max_grad_norm": max_grad_norm,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.eps_inside_sqrt = eps_inside_sqrt
        self._lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one LAMB update to every parameter that has a gradient.

        Parameters whose ``grad`` is ``None`` are skipped: no state is created, their step
        counter does not advance and they contribute no coefficient.

        :param closure: re-evaluates the model and returns the loss; called with grad enabled.
        :returns: the closure's loss, or ``None`` without a closure.
        :raises RuntimeError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        coeffs: list[torch.Tensor] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            max_coeff, min_coeff = group["max_coeff"], group["min_coeff"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                grad = p.grad.to(p.dtype)
                state = self.state[p]
                if not state:
                    # A plain int keeps the bias correction on the host: no device read.
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t: int = state["step"]
                exp_avg: torch.Tensor = state["exp_avg"]
                exp_avg_sq: torch.Tensor = state["exp_avg_sq"]

                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if self.eps_inside_sqrt:
                    denom = exp_avg_sq.add(eps).sqrt_()
                else:
                    denom = exp_avg_sq.sqrt().add_(eps)
                update = exp_avg / denom
                if decay != 0:
                    update.add_(p, alpha=decay)

                acc = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
                w_norm = torch.linalg.vector_norm(p, dtype=acc)
                u_norm = torch.linalg.vector_norm(update, dtype=acc)
                # Both branches are evaluated on the device; the divisor is made safe so the
                # unused one holds no inf/nan either.
                ratio = w_norm / torch.where(u_norm == 0, torch.ones_like(u_norm), u_norm)
                # Two clamps, max first, mirror the kernel's order when min_coeff > max_coeff.
                ratio = ratio.clamp(max=max_coeff).clamp(min=min_coeff)
                coeff = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))

                if group["bias_correction"]:
                    step_size = lr * (1.0 - beta2**t) ** 0.5 / (1.0 - beta1**t)
                else:
                    step_size = lr
                p.sub_(update.mul_((coeff * step_size).to(p.dtype)))
                coeffs.append(coeff)
        self._lamb_coeffs = coeffs
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios (dimensionless) the last :meth:`step` applied, one per updated
        parameter, in parameter-group then parameter order (parameters without a gradient are
        left out). A new list each call; empty before the first step.

        Reading the values waits for the device (one host transfer per coefficient), so call
        it for logging, not inside the training step.
        """
        return [float(c) for c in self._lamb_coeffs]
