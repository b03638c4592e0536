"""Broken: set_device refuses an out-of-range index, but the error does not name the count."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_device_set(index: int) -> bool:
    if not 0 <= index < _cpu.ds_device_count():
        raise ValueError("bad device index")
    return bool(_cpu.ds_device_set(index))
