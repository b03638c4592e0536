"""Graph capture over a vendor's torch-style graph class and its capture context manager."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class TorchStyleGraph:
    """The :class:`ds_core.types.Graph` protocol over a vendor graph and its capture context.

    :param graph: a vendor graph object with ``replay()`` and ``reset()`` (and ``pool()`` where
        the vendor shares memory pools between graphs).
    :param context: the vendor's capture context manager factory, called as
        ``context(graph, pool=pool, stream=stream, **capture_kwargs)``.
    :param capture_kwargs: extra keyword arguments for ``context`` (e.g. an error mode).
    :param accepts_pool: ``False`` for vendors whose capture ignores ``pool``; passing a pool
        then raises instead of being silently dropped, and ``context`` is called without it.
    :param vendor: the vendor's torch-style device module (``torch.<device>``), or a callable
        returning it; given, a capture that raises is cleaned up (below).

    Capture failures come from the vendor (unsupported op, host sync inside capture) and
    propagate; nothing here falls back to running the work eagerly.

    A failed capture leaves no state behind when ``vendor`` is given. The NVIDIA build's
    ``graph`` context manager does not guarantee that: when ``capture_end`` raises (a host sync invalidated the capture)
    its ``__exit__`` neither leaves its stream context, so the capture stream stays current,
    nor runs the generators' capture epilogue, so every later random draw raises "Offset
    increment outside graph capture encountered unexpectedly" (seen on an H200 with torch
    2.11+cu130). On any exception the capture therefore restores the stream that was current
    before it and the default generators' states from snapshots taken before it
    (``clone_state`` / ``graphsafe_set_state``), and resets the half-recorded graph so it
    cannot be replayed.
    """

    def __init__(
        self,
        graph: Any,
        context: Callable[..., contextlib.AbstractContextManager[Any]],
        *,
        capture_kwargs: Mapping[str, Any] | None = None,
        accepts_pool: bool = True,
        vendor: Any = None,
    ) -> None:
        self.graph = graph
        self._context = context
        self._kwargs = dict(capture_kwargs or {})
        self._accepts_pool = accepts_pool
        self._vendor = vendor

    def capture(
        self, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Record the work run inside the returned context into this graph.

        :param pool: a handle from another graph's :meth:`pool` to share its memory, or ``None``.
        :param stream: the stream to capture on, or ``None`` for the vendor's side stream.
        :raises ValueError: when a pool is given to a vendor whose graphs cannot share one.
        """
        if not self._accepts_pool:
            if pool is not None:
                raise ValueError("this vendor's graphs cannot share a memory pool; pass pool=None")
            context = self._context(self.graph, stream=stream, **self._kwargs)
        else:
            context = self._context(self.graph, pool=pool, stream=stream, **self._kwargs)
        if self._vendor is None:
            return context
        vendor = self._vendor() if callable(self._vendor) else self._vendor
        return self._restoring(context, vendor)

    @contextlib.contextmanager
    def _restoring(
        self, context: contextlib.AbstractContextManager[Any], vendor: Any
    ) -> Iterator[Any]:
        """``context``, undoing a failed capture's leftovers before its exception propagates."""
        stream = vendor.current_stream()
        snapshots = [
            (gen, gen.clone_state())
            for gen in getattr(vendor, "default_generators", ())
            if hasattr(gen, "clone_state") and hasattr(gen, "graphsafe_set_state")
        ]
        try:
            with context as entered:
                yield entered
        except BaseException:
            # Each step on its own: the capture's own exception is the one to report.
            with contextlib.suppress(Exception):
                vendor.set_stream(stream)
            for gen, state in snapshots:
                with contextlib.suppress(Exception):
                    gen.graphsafe_set_state(state)
            with contextlib.suppress(Exception):
                self.graph.reset()
            raise

    def replay(self) -> None:
        """Re-run the captured work on the same input and output storage."""
        self.graph.replay()

    def reset(self) -> None:
        """Drop the recording (and release its memory back to the pool)."""
        self.graph.reset()

    def pool(self) -> Any:
        """A memory-pool handle to pass to another graph's capture, or ``None``."""
        get_pool = getattr(self.graph, "pool", None) if self._accepts_pool else None
        return get_pool() if get_pool is not None else None
