"""Helpers of the plain-PyTorch twins (tests/compat/clients)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def dp_backward(loss_of: Callable[[Any], torch.Tensor], rank_batches: Sequence[Any]) -> list[float]:
    """One data-parallel micro-step in one process: each rank's forward on its own batch, the
    mean of the ranks' losses backward (what averaging the ranks' gradients gives); the
    ranks' losses."""
    losses = [loss_of(batch) for batch in rank_batches]
    (torch.stack(losses).sum() / len(losses)).backward()
    return [loss.item() for loss in losses]


def clip(model: nn.Module, max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def warmup_log_lambda(warmup_num_steps: int) -> Callable[[int], float]:
    """DeepSpeed's ``WarmupLR`` (``warmup_type`` "log", ``warmup_min_lr`` 0) as a
    ``LambdaLR`` factor of ``warmup_max_lr``. Its iteration i = torch's epoch − 1: the min
    before the first scheduler step (epoch 0), then log(i + 1) / log(W) for i < W, then 1."""
    inverse_log = 1.0 / math.log(max(2, warmup_num_steps))
    return lambda epoch: (
        0.0
        if epoch == 0
        else inverse_log * math.log(epoch)
        if epoch - 1 < warmup_num_steps
        else 1.0
    )


def max_rel(got: Sequence[float], want: Sequence[float]) -> float:
    """The largest relative difference of two loss curves."""
    assert len(got) == len(want), (len(got), len(want))
    return max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True))
