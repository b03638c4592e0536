"""DeepSpeed's ``deepspeed.moe`` path; the implementation is :mod:`ds_core.parallel.expert.moe`.

:mod:`ds_core.moe.layer` holds ``MoE`` with DeepSpeed's constructor and return value, and
:mod:`ds_core.moe.utils` DeepSpeed's helpers for expert parameters and optimizer groups.
"""

from __future__ import annotations

from ds_core.parallel.expert.moe import *  # noqa: F403 - the same public names under DeepSpeed's import path
from ds_core.parallel.expert.moe import __all__ as __all__
