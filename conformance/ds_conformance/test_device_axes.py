"""Device edge axes (issue 28 §2): device descriptions are the caller's; an integer argument
in range, just out of range at each end, and of the wrong type: ``ds_device_set``'s index, and
the ``index: int | None`` of every other hook (one check, parametrised over the hooks the specs
give that argument)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from ds_conformance import axes
from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier
from ds_core.types import DeviceProperties

CATEGORY = "device"
pytestmark = tier("basic")


@pytest.mark.parametrize("hook", axes.state_hooks("device"))
@promise("hookspecs", axes.STATE_PROMISE)
@hooks(*axes.state_hooks("device"))
def test_a_returned_state_object_is_the_callers(acc: Any, hook: str) -> None:
    axes.check_state_object(acc, hook, check)


#: Hooks of the category with an integer argument that is never ``None`` (derived from the specs).
INT_HOOKS = [
    (name, arg)
    for name, fn in axes.spec_hooks("device").items()
    for arg, p in inspect.signature(fn).parameters.items()
    if str(p.annotation) == "int"
]
WRONG_TYPES: tuple[object, ...] = ("0", 0.0, 1.0, None, True, False)


@pytest.mark.parametrize(("hook", "arg"), INT_HOOKS)
@promise("ds_device_set", ":param index: device index in ``range(ds_device_count())``.")
@promise("ds_device_set", ":raises ValueError: when ``index`` is out of range, naming the count.")
@promise("ds_device_set", ":raises TypeError: when ``index`` is not an ``int``")
@promise("ds_device_current", ":returns: an index in ``range(ds_device_count())``.")
@hooks("ds_device_set", "ds_device_current", "ds_device_count")
def test_an_index_argument_in_range_out_of_range_and_of_the_wrong_type(
    acc: Any, hook: str, arg: str
) -> None:
    impl, count, start = getattr(acc._h, hook), acc.device_count(), acc.current_device()
    try:
        for index in range(count):
            check(impl(index) is True, f"{hook}({arg}={index})", "not True", "True", hook)
            now = acc.current_device()
            check(now == index and type(now) is int, f"current_device() after {hook}({index})",
                  now, f"the int {index}", "ds_device_current")  # fmt: skip
        for bad in axes.out_of_range(count):
            with pytest.raises(ValueError, match=rf"(?<![\d-]){count}(?!\d)"):  # the count
                impl(bad)
        for wrong in WRONG_TYPES:
            with pytest.raises(TypeError):
                impl(wrong)
            now = acc.current_device()
            check(type(now) is int and 0 <= now < count, f"current_device() after {hook}"
                  f"({wrong!r}) raised", now, f"an int in range({count})", "ds_device_current")  # fmt: skip
    finally:
        acc.set_device(start)


def _index_promises(fn: Any) -> Any:
    """Link ``fn`` to the ``:param index:`` sentence of every hook the index axis covers."""
    for hook in axes.index_hooks():
        fn = promise(hook, ":param index: device index, or ``None`` for the current device.")(fn)
    return fn


@pytest.mark.parametrize("hook", axes.index_hooks())
@_index_promises
@promise("hookspecs", axes.INDEX_RULE)
@promise("hookspecs", axes.RANGE_ERRORS)
@hooks(*axes.index_hooks())
def test_an_optional_index_in_range_none_out_of_range_and_of_the_wrong_type(
    acc: Any, hook: str
) -> None:
    axes.skip_before_ranges(acc)
    count, start = acc.device_count(), acc.current_device()
    try:
        for index in (None, *range(count)):
            result = axes.call_with_index(acc, hook, index)
            check(result is not None, f"{hook}(index={index})", result, "a result", hook)
            got = result.index if isinstance(result, DeviceProperties) else None
            want = start if index is None else index
            check(got in (None, want), f"{hook}(index={index}).index", got, str(want), hook)
        for bad in axes.out_of_range(count):
            with pytest.raises(ValueError, match=rf"(?<![\d-]){count}(?!\d)"):  # the count
                axes.call_with_index(acc, hook, bad)
        for wrong in axes.NOT_INTS:
            with pytest.raises(TypeError):
                axes.call_with_index(acc, hook, wrong)
        now = acc.current_device()
        check(now == start, f"current_device() after {hook}'s refused calls", now, str(start),
              hook)  # fmt: skip
    finally:
        acc.set_device(start)
