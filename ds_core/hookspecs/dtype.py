"""Data types the device computes in."""

from __future__ import annotations

from typing import Final

import torch

from ds_core.hookspecs._contract import FACADE, MAY_CREATE_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Data types the device computes in.": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
def ds_dtype_supported() -> frozenset[torch.dtype]:
    """Return the dtypes the device stores and does arithmetic in.

    A dtype is listed only when the vendor reports it for this device (e.g. bf16 only on
    hardware that has it); the conformance suite round-trips and computes in each one. The
    ``fp16``/``bf16``/``fp64``/``fp8`` capabilities are derived from this set.

    Device context: may create one.

    Use in backends: required. Facade: ``supported_dtypes()``, ``is_bf16_supported()``...
    """
