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
@promise("ds_rng_set_state", ":param state: a tensor returned by ``ds_rng_get_state``")
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


def _draw(acc: Any, index: int) -> torch.Tensor:
    return torch.rand(4, device=acc.device(index)).cpu()


@pytest.mark.parametrize("all_devices", [False, True])
@promise("hookspecs", axes.SEED_RULE)
@promise("ds_rng_manual_seed", ":param seed: a non-negative int.")
@promise("ds_rng_manual_seed", ":param all_devices: seed every visible device")
@hooks("ds_rng_manual_seed")
def test_a_seed_at_each_end_of_its_range_out_of_it_and_of_the_wrong_type(
    acc: Any, all_devices: bool
) -> None:
    axes.skip_before_ranges(acc)
    seed, here = acc._h.ds_rng_manual_seed, acc.current_device()
    other = next((i for i in range(acc.device_count()) if i != here), None)
    unrelated = 987654321  # what every generator holds before each seeding below
    for value in (0, 1, 2**63, 2**64 - 1):  # both ends, and past a signed 64-bit int
        acc.manual_seed_all(value)
        want_here = _draw(acc, here)
        want_other = _draw(acc, other) if other is not None else None
        acc.manual_seed_all(unrelated)
        left_other = _draw(acc, other) if other is not None else None
        acc.manual_seed_all(unrelated)
        check(seed(value, all_devices) is True, f"manual_seed({value}, {all_devices})",
              "not True", "True", "ds_rng_manual_seed")  # fmt: skip
        got = _draw(acc, here)
        check(torch.equal(got, want_here), f"draws after manual_seed({value}, {all_devices})",
              "other draws", f"those after manual_seed_all({value})", "ds_rng_manual_seed")  # fmt: skip
        want = want_other if all_devices else left_other
        if other is not None and want is not None:
            got = _draw(acc, other)
            check(torch.equal(got, want), f"device {other}'s draws after manual_seed({value}, "
                  f"all_devices={all_devices}) on device {here}", "other draws",
                  "seeded" if all_devices else "left alone", "ds_rng_manual_seed")  # fmt: skip
    for bad in (-1, 2**64):  # just out of range at each end
        with pytest.raises(ValueError, match=r"2\*\*64"):
            seed(bad, all_devices)
    for wrong in (*axes.NOT_INTS, None):
        with pytest.raises(TypeError):
            seed(wrong, all_devices)
