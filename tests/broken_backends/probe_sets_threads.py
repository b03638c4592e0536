"""Broken: the probe pins OMP_NUM_THREADS for its own backend, for whichever backend wins."""

import os

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    ProbeResult,
)


@hookimpl
def ds_backend_probe() -> ProbeResult:
    os.environ["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    return _cpu.ds_backend_probe()
