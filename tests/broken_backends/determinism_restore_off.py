"""Broken: restore switches deterministic algorithms off instead of back to their old value."""

import torch
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
    torch.use_deterministic_algorithms(False)
    return True
