"""Op providers shared by torch-style backends: torch's fused AdamW, and vendor AdamW adapters."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, Final

import torch
from torch.utils import _foreach_utils

from ds_core.types import SimpleOpProvider


def fused_adamw_provider(device_type: str) -> SimpleOpProvider:
    """``"fused_adam"``: torch's fused AdamW (``torch.optim.AdamW(fused=True)``) on a device.

    Compatible when this torch's AdamW takes ``fused`` and lists ``device_type`` among the
    device types with fused optimizer kernels. The check reads signatures only.
    """

    def check() -> tuple[bool, str]:
        if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
            return False, f"torch {torch.__version__} has no fused AdamW"
        supported = getattr(_foreach_utils, "_get_fused_kernels_supported_devices", None)
        if supported is not None and device_type not in supported():
            return False, f"torch {torch.__version__} has no fused AdamW kernel for {device_type}"
        return True, f"torch.optim.AdamW(fused=True) on {device_type}"

    return SimpleOpProvider("fused_adam", check, lambda: partial(torch.optim.AdamW, fused=True))


#: AdamW options that only choose an implementation; a vendor's fused kernel satisfies them.
_ADAMW_IMPLEMENTATION_ONLY: Final[frozenset[str]] = frozenset({"foreach", "fused"})


def adamw_compatible(
    optimizer: Callable[..., Any], accepts: Collection[str], *, name: str
) -> Callable[..., Any]:
    """Adapt a vendor's fused AdamW class to ``torch.optim.AdamW``'s arguments and defaults.

    The ``"fused_adam"`` op promises AdamW's signature, while vendor classes take a subset and
    sometimes other defaults (a larger ``eps``, no weight decay). The returned factory binds
    its arguments against ``torch.optim.AdamW``'s signature, so AdamW's defaults apply, and
    passes the names in ``accepts`` on to ``optimizer``. Implementation-only options
    (``foreach``, ``fused``) are dropped; any other AdamW option the vendor lacks raises when
    set to a value other than AdamW's default, instead of being silently ignored.

    :param optimizer: the vendor optimizer class, called as ``optimizer(params, **accepted)``.
    :param accepts: AdamW argument names (besides ``params``) the vendor class takes with
        AdamW's meaning.
    :param name: how error messages name the vendor class.
    :returns: a factory with ``torch.optim.AdamW``'s signature.
    """
    signature = inspect.signature(torch.optim.AdamW)
    unknown = sorted(set(accepts) - set(signature.parameters))
    if unknown:
        raise ValueError(f"torch.optim.AdamW has no argument(s) {', '.join(unknown)}")

    def make(*args: Any, **kwargs: Any) -> Any:
        """Build the vendor optimizer from ``torch.optim.AdamW`` arguments.

        :raises TypeError: on an argument ``torch.optim.AdamW`` does not take.
        :raises ValueError: on an AdamW option the vendor class lacks, set to a non-default.
        """
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        passed: dict[str, Any] = {}
        for key, value in bound.arguments.items():
            default = signature.parameters[key].default
            if key == "params" or key in _ADAMW_IMPLEMENTATION_ONLY:
                continue
            if key in accepts:
                passed[key] = value
            elif not (value is default or (type(value) is type(default) and value == default)):
                raise ValueError(
                    f"{name} has no AdamW option {key}={value!r}; leave it at {default!r} "
                    f"or use torch.optim.AdamW"
                )
        return optimizer(bound.arguments["params"], **passed)

    make.__name__ = make.__qualname__ = f"adamw_compatible({name})"
    return make
