"""``deepspeed.sequence.cross_entropy``: DeepSpeed 0.19.8's sequence- and vocabulary-parallel
cross entropy (``sequence/cross_entropy.py``), and ds_core's
:func:`~ds_core.parallel.sequence.sequence_parallel_cross_entropy`.

:func:`vocab_sequence_parallel_cross_entropy` and :func:`vocab_parallel_cross_entropy` take
DeepSpeed's arguments and give its values and gradients: per-token losses (0 for ignored
tokens), optionally gathered over the sequence-parallel group along dim 0 (DeepSpeed's
sequence-first layout) with a backward that keeps only this rank's slice, so the mean of the
gathered losses is the full-sequence mean on every SP rank and each rank's gradient is that
mean's gradient with respect to its own logits: what the engine's sum over SP ranks expects
(docs/architecture.md §10). The logits' last dimension may be sharded over ``tp_group``.

Differences: ``backend="liger"`` runs the PyTorch computation (DeepSpeed's own fallback when
its Liger kernel cannot run; the values are the same). DeepSpeed's ``VocabParallelCausalLMLoss``
and ``VocabParallelCrossEntropyLoss`` wrappers are not provided.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.comm.groups import get_rank, get_world_size
from ds_core.parallel.sequence.data import sequence_parallel_cross_entropy

__all__ = [
    "sequence_parallel_cross_entropy",
    "vocab_parallel_cross_entropy",
    "vocab_sequence_parallel_cross_entropy",
]


def _parallel(group: Any) -> bool:
    """DeepSpeed's ``pg_utils.is_parallel``: ``None`` means no parallelism here (not the world)."""
    return group is not None and get_world_size(group) > 1


def _all_reduce(t: torch.Tensor, op: str, group: Any) -> None:
    get_accelerator().all_reduce(t, op, group, False)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over vocabulary-sharded logits (DeepSpeed's, in fp32)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits_in: torch.Tensor,
        target: torch.Tensor,
        tp_group: Any,
        start: int,
        end: int,
        ignore_index: int,
    ) -> torch.Tensor:
        target = target.to(torch.long)
        logits = logits_in.float()
        local_max = logits.amax(dim=-1)
        if _parallel(tp_group):
            _all_reduce(local_max, "max", tp_group)
        exp_logits = torch.exp(logits - local_max.unsqueeze(-1))
        sum_exp = exp_logits.sum(dim=-1)
        if _parallel(tp_group):
            _all_reduce(sum_exp, "sum", tp_group)
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < end)
        local_target = (target - start).clamp(min=0, max=logits.shape[-1] - 1)
        target_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logits = torch.where(mine, target_logits, torch.zeros_like(target_logits))
        if _parallel(tp_group):
            _all_reduce(target_logits, "sum", tp_group)  # the one shard holding it
        loss = torch.log(sum_exp) + local_max - target_logits
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(exp_logits, sum_exp, local_target, mine, valid)
        ctx.logits_dtype = logits_in.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        exp_logits, sum_exp, local_target, mine, valid = ctx.saved_tensors
        grad = exp_logits / sum_exp.unsqueeze(-1)  # softmax; minus 1 at the target below
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad *= valid.unsqueeze(-1).to(grad.dtype)
        grad *= grad_output.to(grad.dtype).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


class _GatherSequenceLoss(torch.autograd.Function):
    """All-gather per-token losses over the SP group along dim 0; the backward keeps this
    rank's slice (``sum_gradients=False``, DeepSpeed's ``vocab_sequence_parallel_cross_entropy``)
    or reduce-scatters (``True``, its ``vocab_parallel_cross_entropy(gather_sequence_loss=True)``,
    for a loss computed differently on each rank)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, sum_gradients: bool) -> torch.Tensor:
        size = get_world_size(group)
        ctx.group, ctx.n, ctx.sum_gradients = group, local.shape[0], sum_gradients
        ctx.rank = get_rank(group)
        out = torch.empty((ctx.n * size, *local.shape[1:]), dtype=local.dtype, device=local.device)
        get_accelerator().all_gather(out, local.contiguous(), group, False)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.sum_gradients:
            return grad_output.narrow(0, ctx.rank * ctx.n, ctx.n), None, None
        grad = torch.empty(
            (ctx.n, *grad_output.shape[1:]), dtype=grad_output.dtype, device=grad_output.device
        )
        get_accelerator().reduce_scatter(grad, grad_output.contiguous(), "sum", ctx.group, False)
        return grad, None, None


def _global_sp_sum(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's sum as the value, this rank's ``local`` as what the gradient flows to."""
    if not _parallel(group):
        return local
    total = local.detach().clone()
    _all_reduce(total, "sum", group)
    return local + (total - local.detach())


def _vocab_bounds(
    local_vocab: int, start: int | None, end: int | None, tp_group: Any, device: torch.device
) -> tuple[int, int, int]:
    """``(start, end, global vocabulary)`` of this rank's shard, inferred for equal shards
    and checked across the TP group as DeepSpeed's ``_resolve_vocab_metadata`` does."""
    tp = get_world_size(tp_group) if tp_group is not None else 1
    if start is None or end is None:
        if tp > 1:
            sizes = torch.tensor([local_vocab, -local_vocab], dtype=torch.long, device=device)
            _all_reduce(sizes, "max", tp_group)  # [max, -min]
            if int(sizes[0]) != -int(sizes[1]):
                raise ValueError(
                    "Explicit vocabulary shard bounds are required for uneven tensor-parallel "
                    "shards"
                )
        start = (get_rank(tp_group) if tp > 1 else 0) * local_vocab
        end = start + local_vocab
    if tp == 1:
        if start != 0 or end != local_vocab:
            raise ValueError(
                "Vocabulary shard bounds must cover the complete local vocabulary when TP is "
                f"disabled (got [{start}, {end}) for {local_vocab} logits)"
            )
        return start, end, end
    meta = torch.tensor([start, end, local_vocab], dtype=torch.long, device=device)
    every = torch.empty(3 * tp, dtype=torch.long, device=device)
    get_accelerator().all_gather(every, meta, tp_group, False)
    expected = 0
    for rank, (lo, hi, size) in enumerate(every.view(tp, 3).tolist()):
        if hi - lo != size or size <= 0 or lo != expected:
            raise ValueError(
                f"Vocabulary shard bounds of TP rank {rank} ([{lo}, {hi}) for {size} logits) "
                "must form a contiguous, non-empty partition of the vocabulary starting at 0"
            )
        expected = hi
    return start, end, expected


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Any = None,
    sp_group: Any = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    global_vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    gather_sequence_loss: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """Cross entropy (nats) of logits whose last dimension may be sharded over ``tp_group``,
    and whose leading (sequence) dimension may be sharded over ``sp_group``; DeepSpeed
    0.19.8's function (``sequence/cross_entropy.py``). ``None`` groups mean no parallelism.

    :param vocab_parallel_logits: ``[..., local vocabulary]``, any float dtype (fp32 math).
    :param target: ``[...]`` class indices in the global vocabulary, ``ignore_index`` for
        tokens not counted.
    :param vocab_start_index: first global index of this rank's shard (with
        ``vocab_end_index``; inferred for equal shards).
    :param global_vocab_size: trusted as given (needs explicit bounds); skips the check.
    :param reduction: ``"none"``: per-token losses, 0 where ignored; ``"sum"``: their sum over
        the SP group; ``"mean"``: that sum over the group's counted tokens (the value on
        every SP rank; the gradient reaches this rank's logits only).
    :param gather_sequence_loss: with ``"none"``, gather the per-token losses over
        ``sp_group`` (dim 0); the backward sums every rank's gradient.
    :param backend: ``"torch"`` or ``"liger"`` (both run the PyTorch computation here).
    :returns: fp32 losses: ``target``'s shape (``"none"``), or 0-d.
    :raises ValueError: on mismatched shapes, an empty shard, an unknown ``reduction`` or
        ``backend``, ``gather_sequence_loss`` without ``"none"`` or without ``sp_group``,
        inconsistent vocabulary bounds, or a target outside the vocabulary.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            "vocab_parallel_logits and target must have matching non-vocabulary dimensions"
        )
    if vocab_parallel_logits.shape[-1] == 0 and not _parallel(tp_group):
        raise ValueError("vocab_parallel_logits must contain at least one local vocabulary entry")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"Unsupported reduction: {reduction}")
    if backend not in ("torch", "liger"):
        raise ValueError(f"Unsupported vocabulary-parallel CE backend: {backend}")
    if gather_sequence_loss and reduction != "none":
        raise ValueError("gather_sequence_loss is only supported with reduction='none'")
    if (vocab_start_index is None) != (vocab_end_index is None):
        raise ValueError("vocab_start_index and vocab_end_index must be provided together")
    local_vocab = vocab_parallel_logits.shape[-1]
    if global_vocab_size is not None:
        if vocab_start_index is None or vocab_end_index is None:
            raise ValueError(
                "global_vocab_size requires explicit vocab_start_index and vocab_end_index"
            )
        start, end = vocab_start_index, vocab_end_index
    else:
        start, end, global_vocab_size = _vocab_bounds(
            local_vocab, vocab_start_index, vocab_end_index, tp_group, vocab_parallel_logits.device
        )
    # A target outside the vocabulary belongs to no shard and would give a finite wrong loss.
    bad = (target != ignore_index) & ((target < 0) | (target >= global_vocab_size))
    if bool(bad.any()):
        raise ValueError(f"Target is out of range for vocabulary size {global_vocab_size}")
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        vocab_parallel_logits, target, tp_group, start, end, ignore_index
    )
    if reduction == "none":
        if gather_sequence_loss:
            if sp_group is None:
                raise ValueError("sp_group is required when gather_sequence_loss=True")
            loss = _GatherSequenceLoss.apply(loss, sp_group, True)  # type: ignore[no-untyped-call]
        return loss
    total = _global_sp_sum(loss.sum(), sp_group)
    if reduction == "sum":
        return total
    counted = (target != ignore_index).sum().to(loss.dtype)
    if _parallel(sp_group):
        _all_reduce(counted, "sum", sp_group)
    return total / counted.clamp_min(1)


def vocab_sequence_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    sp_group: Any,
    tp_group: Any = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    ignore_index: int = -100,
    reduction: str = "none",
    gather_sequence_loss: bool = True,
    backend: str = "torch",
) -> torch.Tensor:
    """DeepSpeed 0.19.8's sequence-parallel cross entropy: by default the per-token losses of
    the whole sequence (this rank's shard ``[T/P, ...]`` gathered over ``sp_group`` along dim
    0 into ``[T, ...]``, 0 for ignored tokens), whose backward hands this rank only its own
    slice. ``.mean()`` of the result is then the loss a rank gives the engine (the
    full-sequence mean when no token is ignored; else divide the sum by the counted tokens).

    Other arguments as :func:`vocab_parallel_cross_entropy`; with ``gather_sequence_loss``
    false it is that function (``reduction`` then applies over the SP group).

    :returns: fp32 ``[T, ...]`` losses (gathered), or as :func:`vocab_parallel_cross_entropy`.
    :raises ValueError: as :func:`vocab_parallel_cross_entropy`; also ``gather_sequence_loss``
        with a ``reduction`` other than ``"none"`` or without ``sp_group``.
    """
    if backend not in ("torch", "liger"):
        raise ValueError(f"Unsupported vocabulary-parallel CE backend: {backend}")
    if gather_sequence_loss and reduction != "none":
        raise ValueError("gather_sequence_loss is only supported with reduction='none'")
    if gather_sequence_loss and sp_group is None:
        raise ValueError("sp_group is required when gather_sequence_loss=True")
    loss = vocab_parallel_cross_entropy(
        vocab_parallel_logits,
        target,
        tp_group=tp_group,
        sp_group=sp_group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        ignore_index=ignore_index,
        reduction=reduction,
        backend=backend,
    )
    if not gather_sequence_loss:
        return loss
    gathered: torch.Tensor = _GatherSequenceLoss.apply(loss, sp_group, False)  # type: ignore[no-untyped-call]
    return gathered
