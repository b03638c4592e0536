"""Start hook: hands DeepSpeed the ds_core adapter before DeepSpeed picks an accelerator.

``ds_core_deepspeed.pth`` imports this module at interpreter start only when
``DS_CORE_DEEPSPEED=1``; unset, the ``.pth`` line costs one environment lookup. Imported, it
puts a finder on ``sys.meta_path`` that waits for ``deepspeed.accelerator.real_accelerator``;
when DeepSpeed imports that module, the finder hands it to
``ds_core.interop.deepspeed.find_real_accelerator_spec``, whose loader installs the adapter right
after the module runs, before DeepSpeed's first ``get_accelerator``. DeepSpeed then never checks
``DS_ACCELERATOR`` against its own list, so the variable may name any ds_core backend. Standard
library only: ds_core and torch are imported when DeepSpeed is, not before.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

TARGET = "deepspeed.accelerator.real_accelerator"


class DeepSpeedHookFinder(importlib.abc.MetaPathFinder):
    """Sees only DeepSpeed's accelerator-selection module; every other import passes by."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        from ds_core.interop.deepspeed import find_real_accelerator_spec

        return find_real_accelerator_spec(fullname, path)


def arm() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, DeepSpeedHookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedHookFinder())


arm()
