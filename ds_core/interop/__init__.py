"""Adapters that let other frameworks run on the selected ds_core backend (docs/interop.md).

Importing this package imports nothing else: each adapter is a submodule imported on purpose
(``ds_core.interop.deepspeed``), and imports its framework only when asked to.
"""

from __future__ import annotations
