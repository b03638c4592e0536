"""Broken: the determinism hook records that it turned deterministic algorithms on, but sets
nothing, so an order-sensitive accumulation stays nondeterministic."""

import torch
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import (
    BackendInfo,  # noqa: F401 - used by the identity appended on install
    DeterminismRecord,
)


@hookimpl
def ds_determinism_apply(enabled: bool) -> DeterminismRecord:
    record = DeterminismRecord()
    now = torch.are_deterministic_algorithms_enabled()
    record.settings["torch.use_deterministic_algorithms"] = (now, enabled)
    return record
