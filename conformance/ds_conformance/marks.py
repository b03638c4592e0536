"""Markers the suite's tests carry; the plugin reads them at collection.

- ``hooks(*names)``: the hook specs a test exercises. Every hook spec must be named by at
  least one test (the project checks this against ``ds_core.hookspecs.all_hook_names()``).
- ``promise(hook, fragment)``: one sentence of a hook's docstring the test checks, that is,
  the test fails when the sentence is false. ``hook`` is a hook spec name (``ds_comm_send``),
  or a spec section: a category name (``"comm"``, the module docstring of
  ``ds_core/hookspecs/comm.py``) or ``"hookspecs"`` (the rules shared by every hook, in the
  package docstring). ``fragment`` is verbatim text of exactly one sentence of that docstring
  (whitespace-normalised; see :mod:`ds_conformance.coverage`): a docstring edit that drops
  or rewords the sentence makes the link stale, and ``ds-core conformance --coverage`` fails.
  Stack one ``@promise`` per sentence.
- ``capability(name)``: the test applies only when the backend declares ``name``; otherwise it
  is reported ``skipped (capability absent: name)``, which counts as conformant.
- ``tier(name)``: one of :data:`ds_conformance.TIERS`; set per module with ``pytestmark``.
"""

from __future__ import annotations

import pytest

hooks = pytest.mark.ds_hooks
capability = pytest.mark.ds_capability
tier = pytest.mark.ds_tier


def promise(hook: str, fragment: str) -> pytest.MarkDecorator:
    """The ``ds_promise`` mark linking a test to one docstring sentence of ``hook``.

    :param hook: a hook spec name, a spec category (``"comm"``) or ``"hookspecs"``.
    :param fragment: verbatim text (whitespace-normalised) of exactly one sentence.
    :raises TypeError: when either is not a non-empty string (at import of the test module).
    """
    for field, value in (("hook", hook), ("fragment", fragment)):
        if not isinstance(value, str) or not value.strip():
            raise TypeError(f"promise({field}=...) must be a non-empty string, got {value!r}")
    return pytest.mark.ds_promise(hook, fragment)


MARKER_LINES: tuple[str, ...] = (
    "ds_hooks(*names): hook specs a conformance test covers",
    "ds_promise(hook, fragment): the docstring sentence of hook (containing fragment) a "
    "conformance test checks",
    "ds_capability(name): run only when the backend declares the capability",
    "ds_tier(name): conformance tier (basic, multi-rank, graph, ops)",
)
