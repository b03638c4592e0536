"""Broken: manual_seed seeds the generator but returns False (the spec says True)."""

from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_rng_manual_seed(seed: int, all_devices: bool) -> bool:
    _cpu.ds_rng_manual_seed(seed, all_devices)
    return False
