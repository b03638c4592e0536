"""Profiler ranges: named spans of host time that a vendor's profiler shows on its timeline."""

from __future__ import annotations

from typing import Final

from ds_core.hookspecs._contract import FACADE, MAY_CREATE_CONTEXT, OPTIONAL, unchecked
from ds_core.hookspecs._markers import hookspec

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Profiler ranges: named spans of host time that a vendor's profiler shows on its timeline.": "untestable because a vendor's profiler timeline is outside what a portable suite can read; the torch.profiler range of the core's default is checked (ds_profiler_range_push)",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked(
    ":param msg: the range's name",
    "untestable because a range's name reaches only the vendor's profiler tool, which no "
    "portable check reads",
)
@unchecked(
    "A backend implements it with its vendor's range API",
    "untestable because a vendor profiler's timeline is outside what a portable suite can read",
)
@unchecked(
    "Stops at the first non-``None`` result.",
    "promises nothing: how ds_core dispatches the hook (first result), not what the backend does",
)
def ds_profiler_range_push(msg: str) -> bool:
    """Open a named range, nested inside any open one, and return ``True``.

    A backend implements it with its vendor's range API (NVTX for Nsight Systems, the
    vendor's tracing extension for its profiler) so its profiler sees the range. The core's
    default plugin opens a ``torch.profiler.record_function`` range, which ``torch.profiler``
    shows on every device type; a backend without a vendor range API relies on it.

    :param msg: the range's name, e.g. ``"ds::step"``.

    Device context: may create one (vendor range APIs initialise their runtime).

    Use in backends: optional. Stops at the first non-``None`` result. Facade: ``range_push(msg)``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked(
    "Stops at the first non-``None`` result.",
    "promises nothing: how ds_core dispatches the hook (first result), not what the backend does",
)
def ds_profiler_range_pop() -> bool:
    """Close the innermost range opened by ``ds_profiler_range_push`` and return ``True``.

    :raises ds_core.DSCoreError: when no range is open.

    Device context: may create one.

    Use in backends: optional, implemented together with ``ds_profiler_range_push``. Stops at the
    first non-``None`` result. Facade: ``range_pop()``.
    """
