"""Broken: set_rng_state accepts the state and does nothing with it."""

import torch
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_rng_set_state(state: torch.Tensor, index: int | None) -> bool:
    return True
