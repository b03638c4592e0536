"""This rank's part of a batch under sequence parallelism, and the loss over it.

Under Ulysses sequence parallelism the ranks of one SP group read the same batch
(``mesh.data_rank``, docs/architecture.md §10) and each keeps the contiguous slice
``[r·T/P, (r+1)·T/P)`` of every sequence, ``r`` its SP rank (:func:`shard_sequence`). Positions
then start at ``r·T/P`` (:func:`shard_offset`), not at 0.

The loss, as in DeepSpeed 0.19.8: the engine sums gradients over the SP ranks of a data
replica and averages over the replicas (``world / sp_size``, DeepSpeed's
``runtime/zero/stage_1_and_2.py``; ds_core's :class:`~ds_core.zero.reducer.GradReducer`), so
each SP rank's loss must be the full sequences' loss (the mean over every counted token of the
replica's batch, the same value on every SP rank) whose gradient reaches only this rank's
logits: the SP ranks' gradients then add up to the full batch's. The mean over the rank's
own tokens (``F.cross_entropy`` on the shard) is wrong here: it gives ``P`` times the
gradient with equal shards and mis-weights shards that ignore different numbers of tokens.
:func:`sequence_parallel_cross_entropy` computes the right loss, and
:func:`ds_core.sequence.cross_entropy.vocab_sequence_parallel_cross_entropy` is DeepSpeed's
function for it (per-token losses gathered over the group; take their mean).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from ds_core.accelerator import get_accelerator
from ds_core.comm.groups import get_world_size

__all__ = ["sequence_parallel_cross_entropy", "shard_offset", "shard_sequence"]


def _shard_len(length: int, sp_size: int, what: str) -> int:
    if sp_size < 1:
        raise ValueError(f"sp_size must be positive, got {sp_size}")
    if length % sp_size:
        raise ValueError(
            f"sequence parallel size {sp_size} does not divide the {what} length {length}; "
            f"pad or cut sequences to a multiple of {sp_size}, or choose a "
            "sequence_parallel_size that divides the sequence length"
        )
    return length // sp_size


def shard_sequence(tensor: torch.Tensor, sp_rank: int, sp_size: int, dim: int = 1) -> torch.Tensor:
    """This SP rank's contiguous slice of ``tensor`` along the sequence dimension ``dim``.

    :param tensor: e.g. token ids ``[batch, seq]`` or targets; any tensor with a sequence dim.
    :param sp_rank: this rank's index in its SP group (``engine.mesh.sp_rank``).
    :param sp_size: the SP group's size (``engine.mesh.sp_size``).
    :param dim: the sequence dimension (1 for batch-first data).
    :returns: a view: positions ``[sp_rank·T/P, (sp_rank+1)·T/P)`` of ``dim``.
    :raises ValueError: when ``sp_size`` does not divide the sequence length (naming both) or
        ``sp_rank`` is not in ``[0, sp_size)``.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside [0, {sp_size})")
    n = _shard_len(tensor.shape[dim], sp_size, "sequence")
    return tensor.narrow(dim, sp_rank * n, n)


def shard_offset(seq_len: int, sp_rank: int, sp_size: int) -> int:
    """The position of this rank's first token in the full sequence of ``seq_len`` tokens
    (``sp_rank · seq_len / sp_size``), for position embeddings.

    :raises ValueError: when ``sp_size`` does not divide ``seq_len`` (naming both).
    """
    return sp_rank * _shard_len(seq_len, sp_size, "sequence")


def sequence_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: Any, ignore_index: int = -100
) -> torch.Tensor:
    """Cross entropy of the full sequences from this rank's shard (the loss each SP rank
    hands the engine, see the module docstring).

    The value is the mean over every counted token of the SP group's sequences, the same on
    every rank; the gradient is exactly that mean's gradient with respect to this rank's
    ``logits`` (``(this shard's loss sum) / (tokens counted in the group)``), so the engine's
    sum over the SP group is the full-sequence mean's gradient, however many tokens each
    shard ignores. DeepSpeed 0.19.8's ``vocab_parallel_cross_entropy(..., sp_group=group,
    reduction="mean")`` (``sequence/cross_entropy.py``) has the same value and gradient; it is
    also :func:`ds_core.sequence.cross_entropy.vocab_sequence_parallel_cross_entropy` followed
    by the mean over counted tokens.

    :param logits: ``[..., vocab]`` for this rank's tokens (any float dtype; computed in fp32).
    :param targets: ``[...]`` class indices, ``ignore_index`` for tokens not counted.
    :param group: the SP group (``engine.mesh.sp_group``; ``None`` is every rank).
    :param ignore_index: the target value of uncounted tokens.
    :returns: a 0-d fp32 tensor (nats per token); 0 when no token of the group is counted.
    :raises ValueError: when ``logits`` and ``targets`` disagree in shape.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must agree "
            "except for the vocabulary dimension"
        )
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    counted = (targets != ignore_index).sum().to(torch.float32)
    size = get_world_size(group)
    totals = torch.stack([local_sum.detach(), counted])
    if size > 1:
        get_accelerator().all_reduce(totals, "sum", group, False)
    n = totals[1].clamp_min(1.0)
    share = local_sum / n  # this rank's part of the full mean: its gradient is the full one's
    return share + (totals[0] / n - share).detach()
