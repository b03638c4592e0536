"""Device enumeration, selection, synchronisation and properties."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ds_conformance.helpers import check, run_python
from ds_conformance.marks import hooks, promise, tier
from ds_core.types import DeviceProperties

pytestmark = tier("basic")


_COUNT = """
import json
from ds_core import get_accelerator
print(json.dumps({"count": get_accelerator().device_count()}))
"""


@hooks("ds_device_count")
@promise("ds_device_count", ":returns: an int ≥ 1 once the backend is selected.")
@promise(
    "ds_device_count",
    "Return the number of devices visible to this process (honouring visible-devices variables).",
)
def test_count_is_positive(acc: Any) -> None:
    """An int ≥ 1; on cpu, the launcher's ``LOCAL_WORLD_SIZE`` (1 when it is unset)."""
    n = acc.device_count()
    check(isinstance(n, int) and n >= 1, "device_count()", n, "an int ≥ 1", "ds_device_count()")
    if acc.device_type != "cpu":
        return
    # cpu devices are the launcher's local ranks, so the environment is the independent answer
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    for env, want in (({}, 1), ({"LOCAL_WORLD_SIZE": "2"}, 2)):
        got = run_python(_COUNT, env=env, base_env=base)["count"]
        call = f"ds_device_count() with {env or 'LOCAL_WORLD_SIZE unset'}"
        check(got == want, "device_count()", got, str(want), call)


@hooks("ds_device_set", "ds_device_current")
@promise("ds_device_set", "Make ``index`` this process's current device.")
@promise("ds_device_set", ":returns: ``True``.")
@promise("ds_device_current", "Return the index of this process's current device.")
def test_index_round_trips_through_set_and_current(acc: Any) -> None:
    start = acc.current_device()
    try:
        for index in range(acc.device_count()):
            done = acc.set_device(index)
            check(done is True, f"set_device({index})", done, "True", f"set_device({index})")
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
@promise("ds_device_set", ":raises ValueError: when ``index`` is out of range, naming the count.")
@promise("ds_device_set", ":param index: device index in ``range(ds_device_count())``.")
def test_set_out_of_range_raises_value_error(acc: Any) -> None:
    """Just out of range at each end; the error names the count (the fix for the caller)."""
    count = acc.device_count()
    for index in (count, -1):
        with pytest.raises(ValueError, match=rf"\b{count}\b"):
            acc.set_device(index)


@hooks("ds_device_current", "ds_device_synchronize")
@promise("ds_device_synchronize", ":returns: ``True``.")
@promise("ds_device_synchronize", ":param index: device index, or ``None`` for the current device.")
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
@promise(
    "ds_device_properties", "Describe a device: name, index, total memory in bytes, vendor extras."
)
@promise("ds_device_properties", ":returns: a :class:`ds_core.types.DeviceProperties`.")
def test_properties_describe_each_device(acc: Any) -> None:
    for index in range(acc.device_count()):
        props = acc.device_properties(index)
        check(
            isinstance(props, DeviceProperties),
            "type",
            type(props).__name__,
            "DeviceProperties",
            f"ds_device_properties({index})",
        )
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


_SEVERAL = """
import json
from ds_core import get_accelerator
acc = get_accelerator()
out = {"count": acc.device_count(), "initial": acc.current_device(), "after_set": [],
       "props": [], "default_props": []}
for i in reversed(range(out["count"])):  # descending: a stale "current" cannot look right
    acc.set_device(i)
    out["after_set"].append(acc.current_device())
    out["default_props"].append(acc.device_properties(None).index)
    out["props"].append([acc.device_properties(j).index for j in range(out["count"])])
print(json.dumps(out))
"""


@hooks("ds_device_count", "ds_device_set", "ds_device_current", "ds_device_properties")
@promise("ds_device_current", ":returns: an index in ``range(ds_device_count())``.")
@promise("ds_device_properties", ":param index: device index, or ``None`` for the current device.")
def test_several_devices_are_told_apart(acc: Any) -> None:
    """With ≥ 2 devices (cpu: 3, presented through the launcher environment), every
    device-indexed hook answers for the device asked, not for device 0 or the current one."""
    env: dict[str, str] = {}
    if acc.device_type == "cpu":
        env = {"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "1"}
    elif acc.device_count() < 2:
        pytest.skip("one device: device-indexed hooks need ≥ 2 to tell indices apart")
    r = run_python(_SEVERAL, env=env)
    n = r["count"]
    if env:
        check(n == 3, "device_count()", n, "3", "LOCAL_WORLD_SIZE=3")
        check(r["initial"] == 1, "current_device()", r["initial"], "1", "LOCAL_RANK=1")
    descending = list(reversed(range(n)))
    every = [list(range(n))] * n
    for what, got, want in (
        ("current_device() after each set_device(i)", r["after_set"], descending),
        ("device_properties(None).index after each set_device(i)", r["default_props"], descending),
        ("[device_properties(j).index for j] after each set_device(i)", r["props"], every),
    ):
        check(got == want, what, got, str(want), f"i = {descending}")


@hooks("ds_device_synchronize", "ds_stream_create")
@promise(
    "ds_device_synchronize", "Block the host until all work queued on the device has finished."
)
def test_synchronize_waits_for_every_stream_of_the_device(acc: Any) -> None:
    """Work queued on a side stream and on the current one is complete once synchronize()
    returns: both streams answer query() True and the results are on the host as computed."""
    side = acc.Stream()
    x = torch.arange(1 << 18, dtype=torch.float32, device=acc.device())
    side.wait_stream(acc.current_stream())
    with acc.stream(side):
        y = x * 3 + 1
    z = x * 2
    acc.synchronize()
    for what, stream in (("side", side), ("current", acc.current_stream())):
        done = stream.query()
        check(
            done is True,
            f"{what} stream query() after synchronize()",
            done,
            "True",
            "ds_device_synchronize(None)",
        )
    want = torch.arange(1 << 18, dtype=torch.float32)
    check(
        torch.equal(y.cpu(), want * 3 + 1),
        "side-stream result",
        "different",
        "x*3+1",
        "synchronize()",
    )
    check(
        torch.equal(z.cpu(), want * 2), "current-stream result", "different", "x*2", "synchronize()"
    )


@hooks("ds_stream_current", "ds_stream_default", "ds_rng_get_state", "ds_rng_default_generator")
@promise("hookspecs", "``index`` is a device index, ``None`` meaning the current device.")
@promise("ds_stream_current", ":param index: device index, or ``None`` for the current device.")
@promise("ds_stream_default", ":param index: device index, or ``None`` for the current device.")
@promise("ds_rng_get_state", ":param index: device index, or ``None`` for the current device.")
@promise(
    "ds_rng_default_generator", ":param index: device index, or ``None`` for the current device."
)
@promise("ds_memory_info", ":param index: device index, or ``None`` for the current device.")
def test_none_means_the_current_device_for_every_index_argument(acc: Any) -> None:
    """With each device current in turn, a hook given ``None`` answers as given that index."""
    start = acc.current_device()
    try:
        for index in range(acc.device_count()):
            acc.set_device(index)
            where = f"set_device({index})"
            for what, none, explicit in (
                ("current_stream", acc.current_stream(None), acc.current_stream(index)),
                ("default_stream", acc.default_stream(None), acc.default_stream(index)),
                ("default_generator", acc.default_generator(None), acc.default_generator(index)),
                ("memory_info().total", acc.memory_info(None).total, acc.memory_info(index).total),
            ):
                check(none == explicit, f"{what}(None)", none, f"{what}({index})", where)
            same = torch.equal(acc.get_rng_state(None), acc.get_rng_state(index))
            check(same, "get_rng_state(None)", "different", f"get_rng_state({index})", where)
    finally:
        acc.set_device(start)
