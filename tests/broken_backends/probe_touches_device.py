"""Broken: the probe imports an undeclared vendor runtime, whose import starts its workers."""

from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from ds_backend_cpu.plugin import ds_device_count

from ds_core import hookimpl
from ds_core.types import BackendInfo, ProbeResult  # noqa: F401 - BackendInfo: identity


@hookimpl
def ds_backend_probe() -> ProbeResult:
    import ds_fake_vendor_runtime

    ds_fake_vendor_runtime.init()
    # imported=() hides the vendor module the probe just loaded.
    return ProbeResult(True, "fake device found by initialising its runtime", ds_device_count())
