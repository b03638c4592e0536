"""Markers the suite's tests carry; the plugin reads them at collection.

- ``hooks(*names)``: the hook specs a test exercises. Every hook spec must be named by at
  least one test (the project checks this against ``ds_core.hookspecs.all_hook_names()``).
- ``capability(name)``: the test applies only when the backend declares ``name``; otherwise it
  is reported ``skipped (capability absent: name)``, which counts as conformant.
- ``tier(name)``: one of :data:`ds_conformance.TIERS`; set per module with ``pytestmark``.
"""

from __future__ import annotations

import pytest

hooks = pytest.mark.ds_hooks
capability = pytest.mark.ds_capability
tier = pytest.mark.ds_tier

MARKER_LINES: tuple[str, ...] = (
    "ds_hooks(*names): hook specs a conformance test covers",
    "ds_capability(name): run only when the backend declares the capability",
    "ds_tier(name): conformance tier (basic, multi-rank, graph, ops)",
)
