"""A CPU clone declaring ``pinned_memory``, with correct pinned-buffer hooks; the ``pinned_*``
broken backends import it and replace the one hook that carries their bug.

Its buffers are pageable (a CPU build of torch cannot page-lock), so every clone also fails
the page-locking checks; each one's planted bug is what its own docstring names.
"""

import weakref

import torch
from ds_backend_cpu import plugin as _cpu
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported

from ds_core import hookimpl

#: the buffers ``ds_memory_alloc_pinned`` handed out, by id.
OWNED: dict[int, weakref.ref[torch.Tensor]] = {}


@hookimpl
def ds_backend_capabilities() -> frozenset[str]:
    return _cpu.ds_backend_capabilities() | {"pinned_memory"}


@hookimpl
def ds_memory_pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def owned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    OWNED[id(t)] = weakref.ref(t)
    return t


def take_owned(tensor: torch.Tensor) -> None:
    """Forget ``tensor`` as ours, refusing one ``ds_memory_alloc_pinned`` did not return."""
    ref = OWNED.pop(id(tensor), None)
    if ref is None or ref() is not tensor:
        raise ValueError("not a tensor alloc_pinned returned")


@hookimpl
def ds_memory_alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return owned_empty(shape, dtype)


@hookimpl
def ds_memory_free_pinned(tensor: torch.Tensor) -> bool:
    take_owned(tensor)
    tensor.untyped_storage().resize_(0)
    return True
