"""Activation checkpointing with DeepSpeed's API: ``ds_core.checkpointing.checkpoint(fn, *args)``
and ``configure(...)``, as ``deepspeed.checkpointing``.

:func:`checkpoint` runs ``fn`` without keeping its intermediate activations and runs it again
during backward to rebuild them: ``torch.utils.checkpoint.checkpoint`` (non-reentrant, random
state restored for the recomputation, so dropout draws the same masks). Memory saved per
checkpointed layer is its activations less its inputs; bench/activation_checkpointing.py
measures it on the GPT example.

The ``activation_checkpointing`` config section (read by :func:`configure`, as in DeepSpeed,
where the engine itself does not apply it):

- ``cpu_checkpointing``: the inputs kept for the recomputation are held in host memory
  (``torch.autograd.graph.save_on_cpu``) and copied back for backward;
- ``synchronize_checkpoint_boundary``: the device is synchronised before and after each
  checkpointed forward (``get_accelerator().synchronize()``);
- ``profile``: each checkpointed forward's time is logged (``ds_core.checkpointing`` logger,
  milliseconds);
- ``partition_activations``: DeepSpeed splits the saved inputs across the *model-parallel*
  group; ds_core has no model parallelism, so that group is one rank and there is nothing to
  split, exactly as DeepSpeed with model-parallel size 1. Accepted for that reason;
- ``contiguous_memory_optimization``, ``number_checkpoints``: DeepSpeed's pre-allocated
  buffer for partitioned activations; with nothing partitioned there is no buffer. Accepted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from ds_core.accelerator import get_accelerator
from ds_core.errors import ConfigError
from ds_core.zero.config import DSConfig, load_config

__all__ = ["checkpoint", "configure", "is_configured", "reset", "settings"]

log = logging.getLogger("ds_core.checkpointing")


@dataclass
class _Settings:
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_settings = _Settings()
_configured = False


def settings() -> _Settings:
    """The settings :func:`checkpoint` uses now (a copy)."""
    return _Settings(**vars(_settings))


def _section(deepspeed_config: Any) -> Mapping[str, Any]:
    if isinstance(deepspeed_config, DSConfig):
        cfg = deepspeed_config
    elif isinstance(deepspeed_config, (str, os.PathLike, Mapping)):
        cfg = load_config(deepspeed_config, 1)
    else:
        raise ConfigError(
            "configure(deepspeed_config=...) must be a dict, a config file path or a loaded "
            f"DSConfig, got {type(deepspeed_config).__name__}"
        )
    return cfg.activation_checkpointing.model_dump()


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how :func:`checkpoint` works; DeepSpeed's ``checkpointing.configure`` signature.

    Values come from ``deepspeed_config``'s ``activation_checkpointing`` section, then the
    keyword arguments override them (DeepSpeed's order).

    :param mpu_: a model-parallel unit: not supported (ds_core is data-parallel only).
    :param deepspeed_config: a config dict, file path or ``DSConfig``.
    :param partition_activations: see the module docstring (one-rank model-parallel group).
    :param contiguous_checkpointing: ``contiguous_memory_optimization``.
    :param num_checkpoints: ``number_checkpoints``.
    :param checkpoint_in_cpu: ``cpu_checkpointing``: keep saved inputs in host memory.
    :param synchronize: ``synchronize_checkpoint_boundary``.
    :param profile: log each checkpointed forward's time in milliseconds.
    :raises ConfigError: ``mpu_`` given, an invalid config, or
        ``contiguous_checkpointing`` without ``partition_activations`` (DeepSpeed's rule).
    """
    global _settings, _configured
    if mpu_ is not None:
        raise ConfigError(
            "checkpointing.configure(mpu_=...): model parallelism is not supported by ds_core; "
            "pass mpu_=None"
        )
    new = _Settings()
    if deepspeed_config is not None:
        for key, value in _section(deepspeed_config).items():
            setattr(new, key, value)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(new, key, value)
    if new.contiguous_memory_optimization and not new.partition_activations:
        raise ConfigError(
            "activation_checkpointing.contiguous_memory_optimization needs "
            "partition_activations (DeepSpeed's rule); enable both or neither"
        )
    _settings = new
    _configured = True


def is_configured() -> bool:
    """Whether :func:`configure` was called (since the last :func:`reset`)."""
    return _configured


def reset() -> None:
    """Back to the defaults (DeepSpeed's ``reset`` frees its contiguous buffers; there are
    none here)."""
    global _settings, _configured
    _settings = _Settings()
    _configured = False


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` without keeping its activations; they are recomputed in backward.

    Gradients equal those of ``function(*args)`` (the recomputation restores the random state).
    Tensors among ``args`` that need no gradient are fine (non-reentrant checkpointing).

    :returns: what ``function`` returns.
    """
    s = _settings
    sync = s.synchronize_checkpoint_boundary
    if sync:
        _synchronize()
    start = time.perf_counter() if s.profile else 0.0
    saving: contextlib.AbstractContextManager[Any] = (
        torch.autograd.graph.save_on_cpu(pin_memory=False)
        if s.cpu_checkpointing
        else contextlib.nullcontext()
    )
    with saving:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    if sync:
        _synchronize()
    if s.profile:
        log.info(
            "checkpoint %s forward: %.3f ms",
            getattr(function, "__name__", type(function).__name__),
            (time.perf_counter() - start) * 1e3,
        )
    return out


def _synchronize() -> None:
    get_accelerator().synchronize()
