"""Contiguous staging of collective arguments: the facade's half of the rule in
:mod:`ds_core.hookspecs.comm` that collective hooks receive contiguous tensors only.

Process-group libraries address a buffer as a pointer and an element count, so a strided view
handed to one is read and written as if its elements were adjacent: gloo reduces the column
``x[:, 1]`` of a 4×4 as the four elements from ``x[0, 1]`` on (``x[0, 1:]`` and ``x[1, 0]``),
silently. Every backend shares the facade, so the rule is kept here once, not in each hook:

- an input (``all_gather``, ``reduce_scatter``, ``all_to_all`` ``input``) that is not contiguous
  is passed as a contiguous copy, made at call time on the current stream (the collective is
  ordered after it by the stream contract);
- an in-place buffer (``all_reduce``, ``broadcast``) or an output that is not contiguous is
  passed as a contiguous temporary (a copy, for in-place buffers, an empty tensor for outputs)
  and copied back into the caller's view once the collective has completed: before a
  synchronous call returns, in ``wait()`` for an asynchronous one;
- the handle holds every temporary until its ``wait()`` has copied back, so the buffers the
  hook was given stay alive for as long as the contract asks;
- a non-contiguous buffer that is written (in-place or output) and whose elements may share
  memory (a stride of 0, as from ``expand()``) is rejected before any communication with a
  ``ValueError``: copying a result back into it would have no defined outcome.

Contiguous arguments pass through untouched; checking costs one ``is_contiguous()`` per tensor.

Point-to-point calls add two things here: a peer is checked before any communication (an int,
another rank of the world), and a library error, at the call or at ``wait()``, is re-raised
naming the operation and the peer (:class:`PeerWork`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_core.types import COMPLETED, Work


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (false only when provably not).

    Dims of size 1 are ignored; the others, from the smallest stride, must each step past the
    whole span of the previous ones, which holds for every slice, transpose and permutation of
    a tensor that owns its memory and fails for a stride of 0.
    """
    span = 1
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * size
    return False


class StagedWork:
    """Handle of a collective run on contiguous temporaries: ``wait()`` waits for the
    collective, then copies each temporary back into the caller's view (once; later calls do
    nothing)."""

    __slots__ = ("_back", "_keep", "_work")

    def __init__(
        self,
        work: Work,
        back: list[tuple[torch.Tensor, torch.Tensor]],
        keep: list[torch.Tensor],
    ) -> None:
        self._work: Work | None = work
        self._back = back
        self._keep = keep

    def wait(self) -> bool:
        """Complete the collective and write its results into the caller's views.

        :returns: ``True``.
        """
        if self._work is not None:
            self._work.wait()
            for view, staged in self._back:
                view.copy_(staged)
            # Dropped only now: the contract keeps every buffer the hook saw alive until here.
            self._work, self._back, self._keep = None, [], []
        return True


class Staging:
    """The temporaries of one collective call (build one per call, only when some argument
    is not contiguous)."""

    __slots__ = ("_back", "_keep")

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._keep: list[torch.Tensor] = []

    def input(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` if contiguous, else a contiguous copy held until the handle's ``wait()``."""
        if t.is_contiguous():
            return t
        staged = t.contiguous()
        self._keep.append(staged)
        return staged

    def inout(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` if contiguous, else a contiguous copy that is copied back into ``t``.

        :param what: the argument, for the error (``"all_reduce tensor"``).
        :raises ValueError: when ``t`` is not contiguous and its elements may share memory.
        """
        if t.is_contiguous():
            return t
        _check_writable(t, what)
        staged = t.contiguous()
        self._back.append((t, staged))
        return staged

    def output(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` if contiguous, else an empty contiguous tensor copied back into ``t``.

        :param what: the argument, for the error (``"all_gather output"``).
        :raises ValueError: when ``t`` is not contiguous and its elements may share memory.
        """
        if t.is_contiguous():
            return t
        _check_writable(t, what)
        staged = torch.empty_like(t, memory_format=torch.contiguous_format)
        self._back.append((t, staged))
        return staged

    def finish(self, work: Work, async_op: bool) -> Work:
        """The handle to return for the hook's ``work``: copies back at ``wait()`` when
        ``async_op``, else at once (the hook has completed), returning a completed handle."""
        handle = StagedWork(work, self._back, self._keep)
        if async_op:
            return handle
        handle.wait()
        return COMPLETED


def _check_writable(t: torch.Tensor, what: str) -> None:
    if _may_overlap(t):
        raise ValueError(
            f"{what} is a non-contiguous view whose elements may share memory (shape "
            f"{tuple(t.shape)}, strides {t.stride()}, e.g. from expand()), so the result "
            "cannot be written into it; pass a tensor that owns each element (t.clone() or "
            "t.contiguous()) and copy the result where it is needed"
        )


def require_contiguous(collective: str, **tensors: torch.Tensor) -> None:
    """Check a hook's tensors against the layout rule (for implementations called directly,
    bypassing the facade that stages non-contiguous views).

    :param collective: the hook's collective, for the error (``"all_reduce"``).
    :param tensors: the hook's tensor arguments by parameter name.
    :raises ValueError: naming the first non-contiguous argument.
    """
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"{collective} {name} is not contiguous (shape {tuple(t.shape)}, strides "
                f"{t.stride()}); collective hooks take contiguous tensors only "
                "(ds_core/hookspecs/comm.py): call the collective through the facade "
                "(ds_core.get_accelerator() or ds_core.comm), which stages views, or pass "
                "t.contiguous() and copy the result back"
            )


# -- point-to-point: peers checked and named (capability "p2p") ------------------------------


def check_peer(rank: int, what: str) -> int:
    """``rank`` checked as a peer: an int, another rank of the world (when it is up).

    :raises ValueError: naming ``what`` and the world size.
    """
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"{what} must be a global rank (an int), got {rank!r}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world, me = dist.get_world_size(), dist.get_rank()
        if not 0 <= rank < world:
            raise ValueError(f"{what}={rank} is not a rank of the world (0..{world - 1})")
        if rank == me:
            raise ValueError(f"{what}={rank} is this rank; a point-to-point peer is another rank")
    return rank


def naming_peer(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call a point-to-point hook; a library error names the peer and the operation."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        raise RuntimeError(f"{what} failed: {exc}") from exc


class PeerWork:
    """A point-to-point handle whose ``wait()`` names the peer when the library fails, and
    keeps a staged send buffer alive until then (``ds_core/hookspecs/comm.py``: buffers are
    the caller's until ``wait()`` returns)."""

    __slots__ = ("_keep", "_what", "_work")

    def __init__(self, work: Work, what: str, keep: torch.Tensor | None = None) -> None:
        self._work: Work | None = work
        self._what = what
        self._keep = keep

    def wait(self) -> bool:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                raise RuntimeError(f"{self._what} failed: {exc}") from exc
            self._work, self._keep = None, None
        return True
