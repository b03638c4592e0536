"""Broken: the determinism policy sets a workspace variable it does not record (nor undo)."""

import os

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    DeterminismRecord,
)


@hookimpl
def ds_determinism_apply(enabled: bool) -> DeterminismRecord:
    record = _cpu.ds_determinism_apply(enabled)
    if enabled:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return record
