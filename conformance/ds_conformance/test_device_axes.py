"""Device edge axes (issue 28 §2): device descriptions are the caller's."""

from __future__ import annotations

from typing import Any

import pytest

from ds_conformance import axes
from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier

CATEGORY = "device"
pytestmark = tier("basic")


@pytest.mark.parametrize("hook", axes.state_hooks("device"))
@promise("hookspecs", axes.STATE_PROMISE)
@hooks(*axes.state_hooks("device"))
def test_a_returned_state_object_is_the_callers(acc: Any, hook: str) -> None:
    axes.check_state_object(acc, hook, check)
