"""Gradient and parameter buckets: the engine's collectives, and the buffers they own.

See [Note: shard layout] in :mod:`ds_core.zero.partition`. A :class:`GradBucket` owns the fp32
gradient buffers of a few parameters that share a process group:

- stages 0/1 keep a persistent full accumulator ``full`` (``rows × S``) that every micro-batch's
  gradient is added into; at the boundary stage 0 all-reduces it in place and stage 1
  reduce-scatters it into a ``shard`` that lives until the step ends;
- stages 2/3 reduce-scatter each micro-batch's gradients through a temporary ``rows × S``
  buffer and add the result into a persistent ``shard`` accumulator (``S`` elements).

Gradients are summed across ranks here; the engine divides by the data-parallel size once, at
the step, together with the loss-scale and clipping factors.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_core.zero.partition import Mode, ZeroParam, copy_into_rows


class GradBucket:
    """fp32 gradient buffers of parameters sharing one group (see the module docstring)."""

    def __init__(self, zparams: list[ZeroParam], stage: int, device: torch.device) -> None:
        self.zparams = zparams
        self.stage = stage
        self.device = device
        self.group: Any = zparams[0].group
        self.rows = zparams[0].rows
        self.offsets: dict[int, int] = {}
        total = 0
        for zp in zparams:
            self.offsets[id(zp)] = total
            total += zp.shard_numel
        #: shard elements per row (Σ s over the bucket's parameters).
        self.S = total
        #: stage 0/1: the persistent full accumulator; stage 2/3: ``None``.
        self.full: torch.Tensor | None = None
        #: stage 1: the reduced shard during a step; stage 2/3: the persistent accumulator.
        self.shard: torch.Tensor | None = None
        #: an asynchronous reduce-scatter in flight: (handle, input, output).
        self.inflight: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        if stage <= 1:
            self.full = torch.zeros(self.rows * self.S, dtype=torch.float32, device=device)
        else:
            self.shard = torch.zeros(self.S, dtype=torch.float32, device=device)

    # -- views -----------------------------------------------------------------------------

    def full_rows(self, zp: ZeroParam, buf: torch.Tensor) -> torch.Tensor:
        """``zp``'s ``(rows, s)`` column block of a ``rows × S`` buffer."""
        off = self.offsets[id(zp)]
        return buf.view(self.rows, self.S)[:, off : off + zp.shard_numel]

    def owned_grad(self, zp: ZeroParam) -> torch.Tensor:
        """This rank's reduced gradient of ``zp``: full-shaped (stage 0) or a flat shard."""
        off = self.offsets[id(zp)]
        if zp.mode is Mode.REPLICATED:
            if self.full is None:
                raise AssertionError(f"stage-0 bucket of {zp.name} has no full buffer")
            return self.full[off : off + zp.numel].view(zp.shape)
        if self.shard is None:
            raise AssertionError(f"bucket of {zp.name} has no reduced shard yet")
        return self.shard[off : off + zp.shard_numel]

    def grad_buffer(self) -> torch.Tensor:
        """The buffer holding this rank's reduced gradients (for norms and scaling)."""
        self.finish()
        buf = self.full if self.stage == 0 else self.shard
        if buf is None:
            raise AssertionError("gradient buffer read before reduction")
        return buf

    def counts_in_norm(self) -> bool:
        """Whether this rank's copy is counted in the global norm: sharded gradients always;
        replicated (stage 0) ones only on the group's first rank, so each counts once."""
        return self.stage > 0 or self.zparams[0].group_rank == 0

    # -- accumulation and reduction ----------------------------------------------------------

    def accumulate(self, zp: ZeroParam, grad: torch.Tensor) -> None:
        """Stage 0/1: add a micro-batch gradient into the full accumulator."""
        if self.full is None:
            raise AssertionError("accumulate() is for stages 0/1")
        copy_into_rows(self.full_rows(zp, self.full), grad, add=True)

    def reduce_pending(self, async_op: bool = False) -> None:
        """Stage 2/3: reduce-scatter this micro-batch's gradients and add them to the shard.

        A parameter that got no gradient contributes zeros. With ``async_op`` the collective
        runs in the background (``overlap_comm``) and :meth:`finish` adds its result; the
        input and output buffers stay owned by the bucket until then.
        """
        from ds_core.accelerator import get_accelerator

        if self.shard is None:
            raise AssertionError("reduce_pending() is for stages 2/3")
        self.finish()
        tmp = torch.zeros(self.rows * self.S, dtype=torch.float32, device=self.device)
        for zp in self.zparams:
            if zp.pending is not None:
                copy_into_rows(self.full_rows(zp, tmp), zp.pending)
                zp.pending = None
        out = torch.empty(self.S, dtype=torch.float32, device=self.device)
        handle = get_accelerator().reduce_scatter(out, tmp, "sum", self.group, async_op)
        self.inflight = (handle, tmp, out)
        if not async_op:
            self.finish()

    def finish(self) -> None:
        """Wait for an in-flight reduce-scatter and add its result to the shard; idempotent."""
        if self.inflight is None:
            return
        handle, _tmp, out = self.inflight
        handle.wait()
        self.inflight = None  # drops the input buffer only now that the collective is done
        if self.shard is None:
            raise AssertionError("reduce-scatter finished after the bucket was torn down")
        self.shard.add_(out)

    def reduce_boundary(self) -> None:
        """Stage 0: all-reduce the accumulator in place; stage 1: reduce-scatter it."""
        from ds_core.accelerator import get_accelerator

        if self.full is None:
            return
        acc = get_accelerator()
        if self.stage == 0:
            acc.all_reduce(self.full, "sum", self.group)
        else:
            self.shard = torch.empty(self.S, dtype=torch.float32, device=self.device)
            acc.reduce_scatter(self.shard, self.full, "sum", self.group)

    def zero(self) -> None:
        """Reset the accumulators after a step (or a skipped step, or ``zero_grad``)."""
        self.finish()
        if self.full is not None:
            self.full.zero_()
            if self.stage == 1:
                self.shard = None  # the reduced shard lives only during the step
        elif self.shard is not None:
            self.shard.zero_()
        for zp in self.zparams:
            zp.pending = None

    def nbytes(self) -> int:
        """Bytes of the persistent gradient buffers."""
        n = 0
        if self.full is not None:
            n += self.full.numel() * 4
        if self.stage >= 2 and self.shard is not None:
            n += self.shard.numel() * 4
        return n


def gather_params(
    zparams: list[ZeroParam],
    rows: int,
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
    async_op: bool = False,
) -> tuple[Any, torch.Tensor, dict[int, int], int]:
    """All-gather the owned shards of ``zparams`` (one group, one dtype) in one collective.

    Each shard is read from the fp32 master when the parameter is SHARDED_STATE, else from
    its partitioned shard.

    :returns: ``(handle, output (rows × S), offsets by id, S)``.
    """
    from ds_core.accelerator import get_accelerator

    offsets: dict[int, int] = {}
    total = 0
    for zp in zparams:
        offsets[id(zp)] = total
        total += zp.shard_numel
    inp = torch.empty(total, dtype=dtype, device=device)
    for zp in zparams:
        off = offsets[id(zp)]
        src = zp.shard if zp.mode is Mode.PARTITIONED else _owned_master(zp)
        if src is None:
            raise AssertionError(f"{zp.name} has no shard to gather")
        inp[off : off + zp.shard_numel].copy_(src.reshape(-1))
    out = torch.empty(rows * total, dtype=dtype, device=device)
    handle = get_accelerator().all_gather(out, inp, group, async_op)
    return handle, out, offsets, total


def _owned_master(zp: ZeroParam) -> torch.Tensor | None:
    if zp.master is not None:
        return zp.master.detach()
    if zp.full is not None:
        return zp.full[zp.owned_slice()]
    return None
