"""The hyper-parameter checks every optimizer of :mod:`ds_core.optim` shares."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_common", "check_at_least"]


def check_common(
    what: str,
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
) -> None:
    """Refuse ``amsgrad`` (none of DeepSpeed's Lamb or 1-bit optimizers has the variant) and a
    ``lr``, ``eps`` or ``weight_decay`` below 0 or ``betas`` outside [0, 1).

    :raises ValueError: naming ``what`` and the argument.
    """
    if amsgrad:
        raise ValueError(f"{what}: amsgrad=True is not supported (DeepSpeed's {what} has none)")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{what}: betas must be two values in [0, 1), got {tuple(betas)}")
    check_at_least(what, 0, lr=lr, eps=eps, weight_decay=weight_decay)


def check_at_least(what: str, low: float, **values: float) -> None:
    """Refuse any of ``values`` below ``low`` (NaN included).

    :raises ValueError: naming ``what`` and the first argument out of range.
    """
    for name, value in values.items():
        if not value >= low:
            raise ValueError(f"{what}: {name} must be >= {low}, got {value}")
