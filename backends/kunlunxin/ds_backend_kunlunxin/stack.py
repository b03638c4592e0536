"""Kunlunxin's PyTorch stack: its module name and the import that switches it on.

Kept apart from :mod:`ds_backend_kunlunxin.plugin` so the plugin and
:mod:`ds_backend_kunlunxin.fused_adam` both import it at their top without importing each
other.
"""

from __future__ import annotations

import importlib
import sys

VENDOR_MODULE = "torch_xmlir"


def activate() -> None:
    """Import torch_xmlir once, which puts torch.cuda in Kunlunxin's CUDA-compatibility mode.

    UNCONFIRMED: whether the import itself creates a device context; it happens only after this
    backend is selected, never in the probe.

    :raises RuntimeError: when torch_xmlir cannot be imported, with the way to reinstall it.
    """
    if VENDOR_MODULE in sys.modules:
        return
    try:
        importlib.import_module(VENDOR_MODULE)
    except ImportError as exc:
        raise RuntimeError(
            f"importing {VENDOR_MODULE} failed ({exc}); reinstall Kunlunxin's xpytorch from the "
            f"vendor installer (see the ds-core-kunlunxin README)"
        ) from exc
