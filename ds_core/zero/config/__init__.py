"""The engine's configuration: DeepSpeed's JSON names and defaults, validated once at the edge.

:func:`load_config` (in :mod:`~ds_core.zero.config.schema`) turns a dict or a JSON file into a
frozen :class:`DSConfig`. The sections live beside it: :mod:`~ds_core.zero.config.sections`
(accelerator, tensor and expert parallelism, ...), :mod:`~ds_core.zero.config.optimizer`,
:mod:`~ds_core.zero.config.offload`; :mod:`~ds_core.zero.config.deepspeed_keys` lists the
DeepSpeed keys that are not fields (ignored knobs, not yet supported), and
:mod:`~ds_core.zero.config.errors` turns validation problems into one readable error.
"""

from __future__ import annotations

from ds_core.zero.config.schema import (
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    ActivationCheckpointingConfig,
    AdamParams,
    BF16Config,
    DSConfig,
    FP16Config,
    LRRangeTestParams,
    OptimizerConfig,
    SchedulerConfig,
    TorchAutocastConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    ZeroConfig,
    load_config,
    read_config_file,
)

__all__ = [
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "ActivationCheckpointingConfig",
    "AdamParams",
    "BF16Config",
    "DSConfig",
    "FP16Config",
    "LRRangeTestParams",
    "OptimizerConfig",
    "SchedulerConfig",
    "TorchAutocastConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "load_config",
    "read_config_file",
]
