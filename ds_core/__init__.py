"""ds_core: one accelerator SDK, any hardware, ZeRO on top.

Importing this package imports no backend and no vendor module and touches no device; the
backend is selected at the first :func:`get_accelerator` (README.md, "How a backend is selected").
"""

from __future__ import annotations

from ds_core import checkpointing  # deepspeed.checkpointing's place
from ds_core.accelerator import (
    Accelerator,
    get_accelerator,
    register_plugin,
    reset_accelerator,
    set_accelerator,
    unregister_plugin,
)
from ds_core.comm import destroy_distributed, init_distributed
from ds_core.errors import (
    BackendSelectionError,
    BackendValidationError,
    ConfigError,
    DSCoreError,
    NotSupportedError,
)
from ds_core.hookspecs import HOOKSPEC_VERSION, hookimpl, hookspec
from ds_core.parallel.tensor import tp_model_init
from ds_core.runtime.config import DeepSpeedConfig
from ds_core.runtime.engine import DeepSpeedEngine
from ds_core.zero import add_config_arguments, initialize
from ds_core.zero.autoep import autoep_model_init

__version__ = "0.1.0"


__all__ = [
    "HOOKSPEC_VERSION",
    "Accelerator",
    "BackendSelectionError",
    "BackendValidationError",
    "ConfigError",
    "DSCoreError",
    "DeepSpeedConfig",
    "DeepSpeedEngine",
    "NotSupportedError",
    "__version__",
    "add_config_arguments",
    "autoep_model_init",
    "checkpointing",
    "destroy_distributed",
    "get_accelerator",
    "hookimpl",
    "hookspec",
    "init_distributed",
    "initialize",
    "register_plugin",
    "reset_accelerator",
    "set_accelerator",
    "tp_model_init",
    "unregister_plugin",
]
