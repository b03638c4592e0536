"""Random number generation: seeding reproduces draws, saved states restore them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier

pytestmark = tier("basic")


def _draw(acc: Any) -> torch.Tensor:
    return torch.rand(257, device=acc.device()).cpu()


def _returns_true(value: Any, call: str) -> None:
    # The spec's return value: True, not merely "no error" (False or None is a broken hook).
    check(value is True, "return value", value, "True", call)


@hooks("ds_rng_manual_seed")
@promise("ds_rng_manual_seed", "Seed the device generator(s) so later draws are reproducible.")
@promise("ds_rng_manual_seed", ":returns: ``True`` once seeded")
def test_seed_reproduces_draws(acc: Any) -> None:
    _returns_true(acc.manual_seed(1234), "manual_seed(1234)")
    a = _draw(acc)
    acc.manual_seed(1234)
    b = _draw(acc)
    acc.manual_seed(4321)
    c = _draw(acc)
    check(
        torch.equal(a, b), "draws after equal seeds equal", False, "True", "manual_seed(1234) twice"
    )
    check(
        not torch.equal(a, c),
        "draws after different seeds equal",
        True,
        "False",
        "manual_seed(1234/4321)",
    )
    _returns_true(acc.manual_seed_all(99), "manual_seed_all(99)")
    d = _draw(acc)
    acc.manual_seed_all(99)
    check(
        torch.equal(d, _draw(acc)),
        "draws after equal seed_all equal",
        False,
        "True",
        "manual_seed_all(99)",
    )


@hooks("ds_rng_get_state", "ds_rng_set_state")
@promise(
    "ds_rng_get_state", "Return a copy of a device generator's state as a CPU ``uint8`` tensor."
)
@promise("ds_rng_get_state", "later draws do not change it")
@promise(
    "ds_rng_set_state",
    "Restore a device generator's state so the next draws repeat those after ``get_state``.",
)
@promise("ds_rng_set_state", ":returns: ``True`` once restored")
@promise("ds_rng_get_state", ":returns: a tensor that ``ds_rng_set_state`` accepts")
def test_state_save_and_restore_gives_identical_draws(acc: Any) -> None:
    acc.manual_seed(7)
    _draw(acc)
    state = acc.get_rng_state()
    check(
        state.device.type == "cpu" and state.dtype == torch.uint8,
        "state",
        (state.device.type, state.dtype),
        "a cpu uint8 tensor",
        "get_rng_state()",
    )
    saved = state.clone()
    first = _draw(acc)
    check(
        torch.equal(state, saved),
        "state after later draws",
        "changed",
        "unchanged (a copy)",
        "get_rng_state()",
    )
    _returns_true(acc.set_rng_state(state), "set_rng_state(state)")
    again = _draw(acc)
    check(
        torch.equal(first, again),
        "draws after set_rng_state",
        "different",
        "identical to those after get_rng_state",
        "set_rng_state(state)",
    )


@hooks("ds_rng_default_generator")
@promise("ds_rng_default_generator", "Return the device's default ``torch.Generator``.")
def test_default_generator_drives_device_draws(acc: Any) -> None:
    gen = acc.default_generator()
    check(
        gen.device.type == acc.device_type,
        "generator.device.type",
        gen.device.type,
        acc.device_type,
        "default_generator()",
    )
    gen.manual_seed(5)
    a = torch.rand(64, device=acc.device()).cpu()
    acc.manual_seed(5)
    b = torch.rand(64, device=acc.device()).cpu()
    check(
        torch.equal(a, b),
        "draws after generator.manual_seed vs manual_seed",
        "different",
        "identical",
        "default_generator()",
    )


@hooks("ds_rng_set_state")
@promise(
    "ds_rng_set_state", ":raises RuntimeError: when ``state`` is not a state of this generator."
)
def test_set_state_refuses_a_state_of_another_shape(acc: Any) -> None:
    """A ``uint8`` tensor too short to be any generator's state, and a valid state cut short."""
    acc.manual_seed(11)
    expected = _draw(acc)
    state = acc.get_rng_state()
    for bad, what in (
        (torch.zeros(3, dtype=torch.uint8), "3 zero bytes"),
        (state[:-1], "a state less its last byte"),
    ):
        acc.manual_seed(11)
        with pytest.raises(RuntimeError):
            acc.set_rng_state(bad)
        # refused before changing anything: the generator still draws what the seed gives
        check(
            torch.equal(_draw(acc), expected),
            "draws after a refused set_rng_state",
            "different",
            "those of manual_seed(11)",
            f"set_rng_state({what})",
        )
