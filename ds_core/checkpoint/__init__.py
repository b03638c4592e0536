"""Checkpoints: atomic native saves, a universal format, resharding loads, export.

Public API:

- :func:`save_checkpoint` / :func:`load_checkpoint` (also ``engine.save_checkpoint`` /
  ``engine.load_checkpoint`` with DeepSpeed's signatures): every rank writes only its own
  shards, or, with ``universal=True``, whole parameters by name; a load accepts either format
  at any world size and ZeRO stage;
- :func:`convert_to_universal`, :func:`consolidated_state_dict`, :func:`export_checkpoint`,
  :func:`inspect_checkpoint` work offline, without a process group;
- :func:`save_16bit_model` writes the model's 16-bit weights (DeepSpeed's
  ``save_16bit_model``);
- :class:`ResumableLoader` wraps a data loader so its position is saved (set it as
  ``engine.training_dataloader``);
- :class:`CheckpointReader` reads and verifies a checkpoint folder;
- :class:`CheckpointError` is raised for every bad argument or bad file; its subclass
  :class:`DiskWriteError` (also an ``OSError``) when the file system refuses a write (full,
  quota, read-only, file size limit), naming the file and the bytes needed.

The on-disk layout is described in ``docs/checkpoints.md``.
"""

from __future__ import annotations

from ds_core.checkpoint._io import CheckpointError, DiskWriteError
from ds_core.checkpoint._load import load_checkpoint
from ds_core.checkpoint._reader import CheckpointReader
from ds_core.checkpoint._save import save_checkpoint
from ds_core.checkpoint.export import (
    consolidated_state_dict,
    convert_to_universal,
    export_checkpoint,
    inspect_checkpoint,
    save_16bit_model,
)
from ds_core.checkpoint.loader import ResumableLoader

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "DiskWriteError",
    "ResumableLoader",
    "consolidated_state_dict",
    "convert_to_universal",
    "export_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
]
