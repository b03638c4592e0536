"""Broken: the probe sets a device-order variable, for whichever backend wins selection."""

import os

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo, ProbeResult  # noqa: F401 - BackendInfo: identity


@hookimpl
def ds_backend_probe() -> ProbeResult:
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # "so indices match nvidia-smi"
    return _cpu.ds_backend_probe()
