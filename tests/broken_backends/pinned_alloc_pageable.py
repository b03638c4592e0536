"""Broken: alloc_pinned returns a pageable buffer of the right shape and dtype.

A CPU clone declaring ``pinned_memory``. Its buffers are pageable (a CPU build of torch
cannot page-lock), so the page-locking checks fail as well; that is the planted bug.
"""

import weakref

import torch
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install

_OWNED: dict[int, weakref.ref[torch.Tensor]] = {}


@hookimpl
def ds_backend_capabilities() -> frozenset[str]:
    return _cpu.ds_backend_capabilities() | {"pinned_memory"}


@hookimpl
def ds_memory_pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


@hookimpl
def ds_memory_alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    _OWNED[id(t)] = weakref.ref(t)
    return t


@hookimpl
def ds_memory_free_pinned(tensor: torch.Tensor) -> bool:
    ref = _OWNED.pop(id(tensor), None)
    if ref is None or ref() is not tensor:
        raise ValueError("not a tensor alloc_pinned returned")
    tensor.untyped_storage().resize_(0)
    return True
