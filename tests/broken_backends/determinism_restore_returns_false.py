"""Broken: determinism restore undoes every setting but returns False (the spec says True)."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    DeterminismRecord,
)


@hookimpl
def ds_determinism_restore(record: DeterminismRecord) -> bool:
    _cpu.ds_determinism_restore(record)
    return False
