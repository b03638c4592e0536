"""``fused_adam`` on Kunlunxin: AdamW whose update runs in Kunlunxin's fused kernel.

The kernel is ``torch.ops.custom_ops.optimizer_AdamW``, registered by Kunlunxin's op packages.
UNCONFIRMED: its signature and semantics are taken from DeepSpeed's KLXPU op builder
(``op_builder/klxpu/fused_adam.py``, not merged upstream as far as we know), which calls it per
parameter as::

    optimizer_AdamW(grad, exp_avg, exp_avg_sq, param, beta1_pow, beta2_pow, lr,
                    beta1, beta2, eps, weight_decay, numel)

with ``beta1_pow = beta1**step`` and ``beta2_pow = beta2**step`` (step counted from 1, after
the increment), ``lr`` as one-element float32 tensors on the parameter's device, decoupled
weight decay, and ``exp_avg``, ``exp_avg_sq`` and ``param`` updated in place. Which Kunlunxin
package registers the op (kunlun_ops, xtorch_ops or torch_xmlir) is also UNCONFIRMED, so
:func:`kernel` activates torch_xmlir and looks the op up when the optimizer steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_backend_kunlunxin.stack import VENDOR_MODULE, activate
from ds_core.backend_kit import module_present

OP_NAMESPACE = "custom_ops"
OP_NAME = "optimizer_AdamW"


def kernel() -> Any:
    """Kunlunxin's fused AdamW op. :raises RuntimeError: when no Kunlunxin package defines it."""
    activate()
    try:
        return getattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME)
    except (AttributeError, RuntimeError) as exc:
        raise RuntimeError(
            f"torch.ops.{OP_NAMESPACE}.{OP_NAME} is not registered: install Kunlunxin's "
            f"kunlun_ops wheels from the vendor's SDK"
        ) from exc


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) stepping every parameter through Kunlunxin's fused kernel.

    Takes AdamW's arguments. ``amsgrad``, ``maximize`` and sparse gradients have no Kunlunxin
    kernel and are refused rather than approximated.

    :raises ValueError: on a negative learning rate, epsilon or weight decay, betas outside
        ``[0, 1)``, or ``amsgrad``/``maximize`` set.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}"
            )
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if amsgrad or maximize:
            raise ValueError(
                "Kunlunxin's fused AdamW kernel has neither amsgrad nor maximize; use "
                "torch.optim.AdamW for those"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        op = kernel()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # The scalar tensors go to the device once per (step, device), not once per param.
            scalars: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                step = state["step"]
                key = (step, param.device)
                if key not in scalars:
                    scalars[key] = tuple(
                        torch.tensor([v], dtype=torch.float32, device=param.device)
                        for v in (beta1**step, beta2**step, group["lr"])
                    )
                beta1_pow, beta2_pow, lr = scalars[key]
                op(
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    param,
                    beta1_pow,
                    beta2_pow,
                    lr,
                    beta1,
                    beta2,
                    group["eps"],
                    group["weight_decay"],
                    param.numel(),
                )
        return loss


class FusedAdamProvider:
    """The ``fused_adam`` op provider: :class:`FusedAdamW` when Kunlunxin's kernel exists.

    ``is_compatible`` imports nothing: before torch_xmlir has been imported it can only say
    the stack is installed; :meth:`load` then activates it and checks the op.
    """

    name = "fused_adam"

    def is_compatible(self) -> tuple[bool, str]:
        if not module_present(VENDOR_MODULE):
            return False, f"{VENDOR_MODULE} is not installed"
        if VENDOR_MODULE not in sys.modules:
            return True, (
                f"{VENDOR_MODULE} is installed; torch.ops.{OP_NAMESPACE}.{OP_NAME} is looked up "
                f"on load"
            )
        if not hasattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME):
            return False, f"torch.ops.{OP_NAMESPACE}.{OP_NAME} is not registered (kunlun_ops)"
        return True, f"Kunlunxin fused kernel torch.ops.{OP_NAMESPACE}.{OP_NAME}"

    def load(self) -> type[FusedAdamW]:
        """Return :class:`FusedAdamW`. :raises RuntimeError: when the kernel is missing."""
        kernel()
        return FusedAdamW


PROVIDER = FusedAdamProvider()
