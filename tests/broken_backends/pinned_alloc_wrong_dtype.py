"""Broken: alloc_pinned returns float32 whatever dtype is asked."""

import torch
from pinned_clone import *  # noqa: F403 - the cpu hooks and a correct pinned-buffer clone
from pinned_clone import OWNED, owned_empty, take_owned  # noqa: F401

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_memory_alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return owned_empty(shape, torch.float32)
