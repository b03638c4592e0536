"""Batch sizes, as DeepSpeed relates them: ``train_batch_size = train_micro_batch_size_per_gpu
× gradient_accumulation_steps × world_size``; any two determine the third.

Deviation from DeepSpeed: a config that sets neither batch size means micro-batch 1 (DeepSpeed
refuses it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_core.zero.config.errors import fail
from ds_core.zero.config.types import as_int

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def batch_sizes(raw: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """Derive (train_batch_size, micro batch, accumulation steps) from any two of them."""
    values: dict[str, int | None] = {}
    problems = []
    for key in BATCH_KEYS:
        value = raw.get(key)
        if value is None:
            values[key] = None
            continue
        try:
            number = as_int(value)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        if number <= 0:
            problems.append(f"{key}: must be > 0, got {number}")
        values[key] = number
    if problems:
        raise fail(problems)
    tb, mb, gas = (values[k] for k in BATCH_KEYS)
    ws = world_size
    facts = (
        f"train_batch_size={tb}, train_micro_batch_size_per_gpu={mb}, "
        f"gradient_accumulation_steps={gas}, world_size={ws}"
    )
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * ws:
            raise fail(
                [
                    f"train_batch_size ({tb}) must equal train_micro_batch_size_per_gpu ({mb}) "
                    f"× gradient_accumulation_steps ({gas}) × world_size ({ws}) = {mb * gas * ws}"
                ]
            )
        return tb, mb, gas
    if tb is not None and mb is not None:
        if tb % (mb * ws):
            raise fail(
                [
                    f"train_batch_size ({tb}) is not divisible by train_micro_batch_size_per_gpu "
                    f"({mb}) × world_size ({ws}) = {mb * ws}, so gradient_accumulation_steps "
                    f"cannot be derived ({facts})"
                ]
            )
        return tb, mb, tb // (mb * ws)
    if tb is not None:
        gas = 1 if gas is None else gas
        if tb % (gas * ws):
            raise fail(
                [
                    f"train_batch_size ({tb}) is not divisible by gradient_accumulation_steps "
                    f"({gas}) × world_size ({ws}) = {gas * ws}, so "
                    f"train_micro_batch_size_per_gpu cannot be derived ({facts})"
                ]
            )
        return tb, tb // (gas * ws), gas
    mb = 1 if mb is None else mb
    gas = 1 if gas is None else gas
    return mb * gas * ws, mb, gas
