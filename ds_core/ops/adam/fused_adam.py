"""``deepspeed.ops.adam.FusedAdam`` with DeepSpeed's arguments, over ``torch.optim.Adam``.

DeepSpeed's FusedAdam is a CUDA multi-tensor kernel; here the update is torch's Adam
(``adam_w_mode=True``: decoupled weight decay, AdamW; ``False``: L2, Adam), with torch's fused
kernel where every parameter is on a device torch has one for, else torch's default
(for-each) path. The arithmetic is Adam's either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ds_core.errors import ConfigError

__all__ = ["FusedAdam"]


def _fusable(params: list[Any]) -> bool:
    devices = set(_get_fused_kernels_supported_devices())
    devices.add(torch._C._get_privateuse1_backend_name())
    tensors = [
        t
        for p in params
        for t in (p["params"] if isinstance(p, dict) else [p])
        if isinstance(t, torch.Tensor)
    ]
    return bool(tensors) and all(
        t.device.type in devices and t.is_floating_point() for t in tensors
    )


class FusedAdam(torch.optim.Adam):
    """Adam / AdamW with ``deepspeed.ops.adam.FusedAdam``'s constructor.

    :param params: parameters or parameter groups.
    :param lr: learning rate. ``betas``, ``eps``, ``weight_decay``: as torch's Adam.
    :param bias_correction: only True (torch's Adam always corrects).
    :param adam_w_mode: decoupled weight decay (AdamW) when True, L2 (Adam) when False.
    :param amsgrad: not supported, as in DeepSpeed (``RuntimeError``).
    :param set_grad_none: ``zero_grad()`` sets gradients to ``None`` (True) or zeros them.
    :raises ConfigError: for ``bias_correction=False``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if not bias_correction:
            raise ConfigError(
                "FusedAdam(bias_correction=False) is not supported by ds_core; torch's Adam "
                "always applies bias correction"
            )
        groups: list[Any] = list(params)
        super().__init__(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            fused=True if _fusable(groups) else None,
            decoupled_weight_decay=adam_w_mode,
        )
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: to ``None`` when ``set_grad_none`` (or ``set_to_none``) says so."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
