"""The ds_core conformance suite: tests a vendor runs against a backend on real hardware.

Run it with ``ds-core conformance --backend NAME [--report DIR]`` or
``pytest --pyargs ds_conformance --ds-backend NAME``. Test modules mirror the hook categories
(``test_<category>.py``); the pytest plugin is :mod:`ds_conformance.plugin`.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: Tiers a run can be limited to (``--ds-tier``); each test module belongs to one.
TIERS: tuple[str, ...] = ("basic", "multi-rank", "graph", "ops")

__all__ = ["TIERS", "__version__"]
