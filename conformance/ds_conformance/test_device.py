"""Device enumeration, selection, synchronisation and properties."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import hooks, tier

pytestmark = tier("basic")


@hooks("ds_device_count")
def test_count_is_positive(acc: Any) -> None:
    n = acc.device_count()
    check(isinstance(n, int) and n >= 1, "device_count()", n, "an int ≥ 1", "ds_device_count()")


@hooks("ds_device_set", "ds_device_current")
def test_index_round_trips_through_set_and_current(acc: Any) -> None:
    start = acc.current_device()
    try:
        for index in range(acc.device_count()):
            acc.set_device(index)
            got = acc.current_device()
            check(got == index, "current_device()", got, str(index), f"set_device({index})")
    finally:
        acc.set_device(start)
    check(
        acc.current_device() == start,
        "current_device()",
        acc.current_device(),
        str(start),
        "restore",
    )


@hooks("ds_device_set")
def test_set_out_of_range_raises_value_error(acc: Any) -> None:
    with pytest.raises(ValueError):
        acc.set_device(acc.device_count())


@hooks("ds_device_current", "ds_device_synchronize")
def test_device_objects_are_usable_by_torch(acc: Any) -> None:
    device = acc.device()
    x = torch.arange(1024, dtype=torch.float32, device=device)
    y = (x * 2 + 1).sum()
    check(acc.synchronize() is True, "synchronize()", False, "True", "ds_device_synchronize(None)")
    check(
        y.device.type == acc.device_type,
        "result.device.type",
        y.device.type,
        acc.device_type,
        "torch op",
    )
    expected = float(2 * sum(range(1024)) + 1024)
    check(y.item() == expected, "sum", y.item(), str(expected), "(arange*2+1).sum() on the device")
    check(
        acc.synchronize(acc.current_device()) is True,
        "synchronize(i)",
        False,
        "True",
        "ds_device_synchronize(i)",
    )


@hooks("ds_device_properties")
def test_properties_describe_each_device(acc: Any) -> None:
    for index in range(acc.device_count()):
        props = acc.device_properties(index)
        check(
            bool(props.name),
            "props.name",
            props.name,
            "a non-empty name",
            f"ds_device_properties({index})",
        )
        check(
            props.index == index,
            "props.index",
            props.index,
            str(index),
            f"ds_device_properties({index})",
        )
        check(
            props.total_memory > 0,
            "props.total_memory",
            props.total_memory,
            "> 0 bytes",
            f"ds_device_properties({index})",
        )
