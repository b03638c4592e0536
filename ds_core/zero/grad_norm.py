"""The global gradient norm: each rank's reduced gradients to one L2 norm over the mesh.

:class:`~ds_core.zero.reducer.GradReducer` decides which of its buffers a rank counts (each
element once in the mesh; replicas count on one rank) and :class:`GlobalNorm` does the
arithmetic: chunked sums of squares, replicas added times zero so that an inf/NaN anywhere
reaches every rank's norm, one all-reduce, the square root. The engine clips with it and
decides non-finite skips from it (:class:`~ds_core.zero.steps.Updater`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ds_core.accelerator import Accelerator

__all__ = ["GlobalNorm", "sum_of_squares"]

#: elements per fp32 partial norm in :func:`sum_of_squares`.
_NORM_CHUNK = 1 << 16


def sum_of_squares(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum of squares of ``buf``'s elements, accumulated in ``dtype``.

    fp32 norms of 64 Ki-element chunks, their squares summed in ``dtype``: one fp32 norm over
    a whole-model buffer drifts (4e-3 relative at 57 M elements on one CPU thread), and a
    ``dtype=float64`` norm copies the buffer to float64 first (8 bytes an element, ~30x the
    time; bench/README.md). Chunking keeps fp32 speed with ~1e-7 relative error.
    """
    flat = buf.reshape(-1)
    whole = flat.numel() // _NORM_CHUNK * _NORM_CHUNK
    partial = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), 2, dim=1)
    total: torch.Tensor = partial.to(dtype).square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], 2).to(dtype).square()
    return total


class GlobalNorm:
    """The L2 norm of gradient buffers spread over the mesh, as a 0-dim device tensor (never
    read on the host here).

    :param acc: the accelerator (the all-reduce, pinned memory).
    :param ranks: ranks the norm sums over (data × tensor × pipeline parallel); 1: none.
    """

    def __init__(self, acc: Accelerator, ranks: int) -> None:
        self.acc = acc
        self.device = acc.device()
        self.ranks = ranks

    def local(self, bufs: Iterable[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's own norm of ``bufs``, no collective."""
        return self._squares(bufs, (), dtype, self.device).sqrt()

    def of_squares(self, parts: Iterable[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The global norm from this rank's sums of squares ``parts`` (device tensors)."""
        total = torch.zeros((), dtype=dtype, device=self.device)
        for part in parts:
            total += part
        return self._over_mesh(total)

    def of(
        self,
        counted: Iterable[torch.Tensor],
        replicas: Iterable[torch.Tensor],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The global norm of device buffers: ``counted`` count, ``replicas`` (counted on
        another rank) only carry their inf/NaN."""
        return self._over_mesh(self._squares(counted, replicas, dtype, self.device))

    def of_host(
        self,
        counted: Iterable[torch.Tensor],
        replicas: Iterable[torch.Tensor],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """:meth:`of` for host buffers: the host sums and sends one number to the device for
        the all-reduce (non-blocking from pinned memory where the backend has it)."""
        local = self._squares(counted, replicas, dtype, None)
        pinned = "pinned_memory" in self.acc.capabilities
        if pinned:
            local = self.acc.pin_memory(local)
        total = torch.empty((), dtype=dtype, device=self.device)
        total.copy_(local, non_blocking=pinned)
        return self._over_mesh(total)

    def _squares(
        self,
        counted: Iterable[torch.Tensor],
        replicas: Iterable[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=dtype, device=device)
        for buf in counted:
            total += sum_of_squares(buf, dtype)
        for buf in replicas:
            # Counted on another rank, but an inf/NaN here (0 × inf is NaN) must still reach
            # the norm, so every rank of the mesh skips the step and clips alike.
            total += sum_of_squares(buf, dtype) * 0
        return total

    def _over_mesh(self, total: torch.Tensor) -> torch.Tensor:
        if self.ranks > 1:
            # Every range and expert is held by exactly one rank (replicas are counted on the
            # group's first rank only, TP replicas on TP rank 0), so the sum over the world
            # counts each once.
            self.acc.all_reduce(total, "sum", None)
        return total.sqrt()
