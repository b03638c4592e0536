"""Config sections added for DeepSpeed compatibility (``torch_autocast``,
``activation_checkpointing``), apart from the core schema in :mod:`ds_core.zero.config`.
(Reading config files, JSON or hjson, is :mod:`ds_core.zero.config_file`.)"""

from __future__ import annotations

import difflib
import importlib.metadata as md
from typing import Any

import torch
from pydantic import BaseModel, field_validator

from ds_core.known_backends import KNOWN_BACKENDS
from ds_core.plugins import BACKEND_GROUP
from ds_core.zero.config_file import parse_config_text
from ds_core.zero.config_types import FROZEN as _FROZEN
from ds_core.zero.config_types import Bool, Int

__all__ = [
    "ActivationCheckpointingConfig",
    "TorchAutocastConfig",
    "accelerator_section_errors",
    "parse_config_text",
]


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


def accelerator_section_errors(section: Any) -> list[str]:
    """Problems in ``accelerator``: each key must name a backend ds_core knows
    (:data:`~ds_core.known_backends.KNOWN_BACKENDS`) or one installed here (an entry point in
    ``ds_core.backends``). A config may carry sections for backends other than the one
    selected (only the selected one's is applied), but a misspelt or unknown name would
    otherwise be ignored without a word."""
    if not isinstance(section, dict):
        return []  # the schema reports the wrong type
    installed = {ep.name for ep in md.entry_points(group=BACKEND_GROUP)}
    known = sorted(set(KNOWN_BACKENDS) | installed)
    errors = []
    for name in section:
        if name not in known:
            match = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
            hint = f"; did you mean '{match[0]}'?" if match else ""
            errors.append(
                f"accelerator.{name}: no backend is named '{name}' (known or installed: "
                f"{', '.join(known)}){hint}"
            )
    return errors
