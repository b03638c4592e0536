"""RNG edge axes (issue 28 §2): states are the caller's, exact round trips, per device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance import axes
from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier

CATEGORY = "rng"
pytestmark = tier("basic")


@pytest.mark.parametrize("hook", axes.state_hooks("rng"))
@promise("hookspecs", axes.STATE_PROMISE)
@promise("ds_rng_get_state", "later draws do not change it")
@hooks(*axes.state_hooks("rng"))
def test_a_returned_state_object_is_the_callers(acc: Any, hook: str) -> None:
    axes.check_state_object(acc, hook, check)


@promise("ds_rng_set_state", "Restore a device generator's state so the next draws repeat")
@hooks("ds_rng_get_state", "ds_rng_set_state")
def test_state_round_trips_exactly_and_per_device(acc: Any) -> None:
    acc.manual_seed(11)
    torch.rand(5, device=acc.device())
    state = acc.get_rng_state()
    acc.set_rng_state(state.clone())
    again = acc.get_rng_state()
    check(torch.equal(again, state), "get_rng_state() after set_rng_state(get_rng_state())",
          "different bytes", "the same bytes (an exact round trip)", "ds_rng_set_state")  # fmt: skip
    if acc.device_count() < 2:
        return
    first, second = acc.current_device(), (acc.current_device() + 1) % acc.device_count()
    other = acc.get_rng_state(second)
    torch.rand(1000, device=acc.device(first))  # draws on the first device only
    check(torch.equal(acc.get_rng_state(second), other), f"get_rng_state({second}) after "
          f"draws on device {first}", "changed", "unchanged (one generator per device)",
          "ds_rng_get_state")  # fmt: skip
    acc.set_rng_state(state, second)
    check(torch.equal(acc.get_rng_state(second), state), f"get_rng_state({second}) after "
          f"set_rng_state(state, {second})", "different", "state", "ds_rng_set_state")  # fmt: skip
    acc.set_rng_state(other, second)
