"""AutoTP under its earlier import path; the implementation is :mod:`ds_core.parallel.tensor`."""

from __future__ import annotations

from ds_core.parallel.tensor import *  # noqa: F403 - the same public names under DeepSpeed's import path
from ds_core.parallel.tensor import __all__ as __all__
