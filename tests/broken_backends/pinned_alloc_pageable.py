"""Broken: alloc_pinned returns a pageable buffer of the right shape and dtype.

Every pinned clone's buffers are pageable here (see ``_shared__pinned_clone.py``): this one's
planted bug is exactly that, so it keeps the clone's hooks unchanged.
"""

from pinned_clone import *  # noqa: F403 - the cpu hooks and a correct pinned-buffer clone
from pinned_clone import OWNED, owned_empty, take_owned  # noqa: F401

from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install
