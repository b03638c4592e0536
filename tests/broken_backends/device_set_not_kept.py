"""Broken: set_device validates the index but current_device keeps answering LOCAL_RANK."""

import os

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_device_set(index: int) -> bool:
    count = _cpu.ds_device_count()
    if not 0 <= index < count:
        raise ValueError(f"device index {index} is out of range: {count} device(s)")
    return True


@hookimpl
def ds_device_current() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)
