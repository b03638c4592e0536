"""Broken: manual_seed hands any int to torch, which maps a negative seed to a large one
instead of refusing it (and raises RuntimeError, not ValueError, past 2**64)."""

import torch
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_rng_manual_seed(seed: int, all_devices: bool) -> bool:
    torch.manual_seed(seed)
    return True
