"""Broken: barrier returns at once (it was "optimised away" for a single-node backend)."""

from typing import Any

from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_comm_barrier(group: Any) -> bool:
    return True
