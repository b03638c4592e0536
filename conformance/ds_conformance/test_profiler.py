"""Profiler ranges: pushes and pops nest, and ``torch.profiler`` sees the core's default ranges."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier
from ds_core.errors import DSCoreError

pytestmark = tier("basic")


@hooks("ds_profiler_range_push", "ds_profiler_range_pop")
@promise(
    "ds_profiler_range_push", "Open a named range, nested inside any open one, and return ``True``."
)
@promise(
    "ds_profiler_range_pop",
    "Close the innermost range opened by ``ds_profiler_range_push`` and return ``True``.",
)
@promise("ds_profiler_range_pop", ":raises ds_core.DSCoreError: when no range is open.")
@promise(
    "ds_profiler_range_push",
    "The core's default plugin opens a ``torch.profiler.record_function`` range",
)
def test_ranges_nest_and_an_unmatched_pop_raises(acc: Any) -> None:
    with torch.profiler.profile() as prof:
        # A value, not merely no error: ``None`` or ``False`` is a broken hook.
        returned = [
            acc.range_push("ds_conformance::outer"),
            acc.range_push("ds_conformance::inner"),
        ]
        torch.ones(8).mul_(2)
        returned += [acc.range_pop(), acc.range_pop()]
    check(
        returned == [True] * 4,
        "range_push, range_push, range_pop, range_pop returned",
        returned,
        "[True, True, True, True]",
        "ds_profiler_range_push/pop",
    )
    names = {e.name for e in prof.events()}
    impl = acc._h.ds_profiler_range_push
    if getattr(impl, "__qualname__", "").startswith("DefaultProfiler."):
        # The core's default range is a torch.profiler range: it must show up there.
        check(
            {"ds_conformance::outer", "ds_conformance::inner"} <= names,
            "torch.profiler events after range_push/range_pop",
            sorted(n for n in names if n.startswith("ds_conformance")),
            "both ranges",
            "ds_profiler_range_push",
        )
    with pytest.raises(DSCoreError, match="range_pop"):
        acc.range_pop()
