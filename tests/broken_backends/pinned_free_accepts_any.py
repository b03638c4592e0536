"""Broken: free_pinned releases whatever tensor it is given, its own or not."""

import torch
from pinned_clone import *  # noqa: F403 - the cpu hooks and a correct pinned-buffer clone
from pinned_clone import OWNED, owned_empty, take_owned  # noqa: F401

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


@hookimpl
def ds_memory_free_pinned(tensor: torch.Tensor) -> bool:
    OWNED.pop(id(tensor), None)
    tensor.untyped_storage().resize_(0)
    return True
