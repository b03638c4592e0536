"""Broken: ds_backend_capabilities initialises the (fake) vendor runtime to see what the device
supports, though its spec says it never needs a device context."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_backend_capabilities() -> frozenset[str]:
    import ds_fake_vendor_runtime

    ds_fake_vendor_runtime.init()
    return _cpu.ds_backend_capabilities()
