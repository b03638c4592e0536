"""ds_core: one accelerator SDK, any hardware, ZeRO on top.

Importing this package imports no backend and no vendor module and touches no device; the
backend is selected at the first :func:`get_accelerator` (see DESIGN.md §4).
"""

from __future__ import annotations

from typing import Any

from ds_core.accelerator import (
    Accelerator,
    get_accelerator,
    register_plugin,
    reset_accelerator,
    set_accelerator,
    unregister_plugin,
)
from ds_core.errors import (
    BackendSelectionError,
    BackendValidationError,
    ConfigError,
    DSCoreError,
    NotSupportedError,
)
from ds_core.hookspecs import HOOKSPEC_VERSION, hookimpl, hookspec

__version__ = "0.1.0"


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """Initialise ``torch.distributed`` for the selected backend; see :func:`ds_core.comm.init_distributed`."""
    from ds_core.comm import init_distributed as _init

    _init(*args, **kwargs)


def destroy_distributed() -> None:
    """Tear down ds_core's and torch's process groups; see :func:`ds_core.comm.destroy_distributed`."""
    from ds_core.comm import destroy_distributed as _destroy

    _destroy()


def initialize(*args: Any, **kwargs: Any) -> Any:
    """Wrap a model for ZeRO training: ``engine, optimizer, dataloader, lr_scheduler``.

    See :func:`ds_core.zero.initialize` for the arguments, units and errors.
    """
    from ds_core.zero import initialize as _initialize

    return _initialize(*args, **kwargs)


__all__ = [
    "HOOKSPEC_VERSION",
    "Accelerator",
    "BackendSelectionError",
    "BackendValidationError",
    "ConfigError",
    "DSCoreError",
    "NotSupportedError",
    "__version__",
    "destroy_distributed",
    "get_accelerator",
    "hookimpl",
    "hookspec",
    "init_distributed",
    "initialize",
    "register_plugin",
    "reset_accelerator",
    "set_accelerator",
    "unregister_plugin",
]
