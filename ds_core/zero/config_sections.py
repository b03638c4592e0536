"""Config sections added for DeepSpeed compatibility (``torch_autocast``,
``activation_checkpointing``) and reading hjson files, apart from the core schema in
:mod:`ds_core.zero.config`."""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import BaseModel, field_validator

from ds_core.errors import ConfigError
from ds_core.zero.config_types import FROZEN as _FROZEN
from ds_core.zero.config_types import Bool, Int

__all__ = ["ActivationCheckpointingConfig", "TorchAutocastConfig", "parse_config_text"]


_AUTOCAST_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
}


class TorchAutocastConfig(BaseModel):
    """``torch_autocast``: run the forward under ``torch.autocast`` (parameters stay fp32)."""

    model_config = _FROZEN

    enabled: Bool = False
    dtype: str = "bfloat16"
    """The autocast dtype: ``bfloat16`` or ``float16`` (DeepSpeed's spellings accepted)."""
    lower_precision_safe_modules: list[str] | None = None
    """DeepSpeed reduces these modules' gradients in the autocast dtype; ds_core reduces in
    ``communication_data_type`` (fp32 by default) whatever the module. Accepted."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in _AUTOCAST_DTYPES:
            raise ValueError(f"must be one of {', '.join(_AUTOCAST_DTYPES)}, got {value!r}")
        return value

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return getattr(torch, _AUTOCAST_DTYPES[self.dtype])  # type: ignore[no-any-return]


class ActivationCheckpointingConfig(BaseModel):
    """``activation_checkpointing``: read by :func:`ds_core.checkpointing.configure`, as
    DeepSpeed's; see that module for what each key does here."""

    model_config = _FROZEN

    partition_activations: Bool = False
    contiguous_memory_optimization: Bool = False
    number_checkpoints: Int | None = None
    cpu_checkpointing: Bool = False
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False


def parse_config_text(text: str, path: str) -> Any:
    """JSON, else hjson (DeepSpeed reads config files with hjson: comments, unquoted keys)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        error = (
            f"config file {path!r} is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}"
        )
    try:
        import hjson
    except ImportError:
        raise ConfigError(
            f"{error}; if it is an hjson file (as DeepSpeed accepts), install the optional "
            "dependency: pip install 'ds-core[hjson]'"
        ) from None
    try:
        return json.loads(json.dumps(hjson.loads(text)))
    except Exception as exc:  # hjson raises its own HjsonDecodeError
        raise ConfigError(f"{error}; nor valid hjson: {exc}") from None
