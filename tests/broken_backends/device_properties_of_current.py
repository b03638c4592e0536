"""Broken: device_properties(i) describes the current device whatever index is asked."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    DeviceProperties,
)


@hookimpl
def ds_device_properties(index: int | None) -> DeviceProperties:
    return _cpu.ds_device_properties(None)
