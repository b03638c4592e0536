"""Broken: set_rng_state ignores a state that is not a generator state instead of raising."""

import torch
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_rng_set_state(state: torch.Tensor, index: int | None) -> bool:
    try:
        return bool(_cpu.ds_rng_set_state(state, index))
    except RuntimeError:
        return True  # the spec says RuntimeError; this backend swallows it
