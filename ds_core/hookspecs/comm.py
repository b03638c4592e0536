"""Collective communication between ranks.

The core's default plugin implements every collective over ``torch.distributed`` with the
backend's comm name; a backend overrides only a collective its process-group library lacks or
does better another way. Collectives take a process group from ``ds_core.comm.new_group`` (or
``None`` for the world), a reduction named by a string (``"sum"``, ``"avg"``, ``"max"``,
``"min"``, ``"product"``), and ``async_op``; they return a handle whose ``wait()`` makes the
result visible, already completed when ``async_op`` is false. Tensors are on the backend's
device; all ranks of the group call the same collective with the same shapes and dtypes.

Ordering and ownership (the stream contract of every collective hook below):

- **Ordered after the current stream at call time.** A collective reads its inputs only after
  all work queued so far on the stream that is current (``ds_stream_current``) when the hook
  is called; a producer queued on that stream needs no event or host sync before the call.
  Work queued on other streams is not waited for: order it with ``Stream.wait_stream`` or an
  event first.
- **``async_op=False``**: the hook returns when the result is ordered before all later work on
  the calling stream; without ``async_streams`` (synchronous devices, the host) it returns
  only once the result is in the output buffer. A synchronous collective blocks while any
  peer has not joined. The returned handle is already completed.
- **``async_op=True``**: the hook returns without waiting for peers. ``handle.wait()`` orders
  completion before later work: where the backend declares ``async_streams`` it makes the
  stream current *at the time of ``wait()``* wait for the collective (the host may return at
  once); where it does not, it blocks the host until the result is in the output buffer.
  Either way, work queued after ``wait()`` sees the result; nothing read before ``wait()``
  returns is guaranteed to (an implementation may complete the collective only in
  ``wait()``). ``wait()`` may be called more than once; later calls do nothing.
  Collectives on different groups may be in flight at once, issued in the same order on
  every rank, and their handles waited in any order.
- **Buffers are the caller's until ``wait()`` returns.** Every tensor handed to a
  collective (inputs and outputs) must stay alive and unmodified, and outputs unread, until
  the handle's ``wait()`` has returned; for a synchronous call, until the hook returns. A
  backend may keep references to them, use them as scratch where a hook says so, and write
  the outputs at any time before ``wait()`` returns.

Point-to-point (``ds_comm_send``, ``ds_comm_recv``, ``ds_comm_batch_isend_irecv``; since
hook version 2, gated by the ``p2p`` capability) follows the same ordering, ownership and
layout rules, with these differences:

- **Peers are global ranks**, members of ``group`` (``None`` = the world), never this rank.
- **Matching is per ordered pair, in issue order.** The n-th send from rank *a* to rank *b*
  on a group is received by the n-th receive *b* posts from *a* on that group; both name the
  same ``tag`` (a library without tags, as NCCL, ignores it: callers never rely on a tag to
  reorder messages). Sizes and dtypes match on both sides.
- **Blocking.** A synchronous send may return before the peer received (the library may
  buffer it) or only once it did; a synchronous receive returns once the data is in the
  buffer (or, with ``async_streams``, ordered before later work on the current stream). So a
  pair of ranks that both send before they receive must use the batched hook, which starts
  every operation of the list before waiting for any.
- **A dead peer is an error, not a hang.** When the peer's process has exited, a
  ``RuntimeError`` naming the peer's global rank and the operation is raised once the library
  notices: by the call or the handle's ``wait()`` (the facade adds the names to a library
  error), or, with ``async_streams``, where the operation runs on the stream, by the next
  synchronisation that waits for that stream's work (the backend names the peer itself).

Layout (the non-contiguous rule of every collective hook below):

- **Hooks receive contiguous tensors only**, and an implementation may rely on it: a
  process-group library addresses a buffer by pointer and element count, so a strided view
  would be read and written as if its elements were adjacent. The facade (and so
  ``ds_core.comm``) gives callers any strided tensor: it passes a contiguous one through
  untouched and stages a non-contiguous one through a contiguous temporary
  (:mod:`ds_core.comm_staging`).
- **A staged call is exact.** A non-contiguous input is copied into the temporary at call
  time (on the current stream, before the collective reads it). A non-contiguous in-place
  buffer or output is written only through its own elements: the result is copied back into
  the caller's view before a synchronous call returns, and in the first ``wait()`` of an
  asynchronous one; nothing outside the view's elements is touched, and the view holds
  nothing defined before that ``wait()`` returns. The handle keeps the temporaries alive
  until then.
- **An in-place buffer or output whose elements may share memory** (non-contiguous with a
  stride of 0, as from ``expand()``) raises ``ValueError`` naming the argument before any
  communication, on every rank that passes one. An input may share memory.
- The core's own hook implementations (the default plugin's, the ``cpu`` backend's) raise
  ``ValueError`` naming the argument when called directly with a non-contiguous tensor.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from ds_core.hookspecs._contract import CALLED_BY_CORE, FACADE, OPTIONAL, USES_CONTEXT, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import P2POp, Work

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Collective communication between ranks.": "promises nothing: a summary of the section; its sentences below carry the promises",
    "Ordering and ownership (the stream contract of every collective hook below):": "promises nothing: a heading; the bullets under it carry the promises",
    "Layout (the non-contiguous rule of every collective hook below):": "promises nothing: a heading; the bullets under it carry the promises",
    "A backend may keep references to them": "promises nothing: a permission to the backend; the caller's side is the sentence before",
    "Sizes and dtypes match on both sides.": "promises nothing: an obligation of the caller, not of the backend",
    "The core's default plugin implements every collective": "promises nothing: describes ds_core's default plugin (ds_core's code) and what a backend may leave to it",
    "Work queued on other streams is not waited for": "promises nothing: tells the caller to order other streams itself; a backend that also waited for them would conform",
    "Every tensor handed to a collective (inputs and outputs) must stay alive": "promises nothing: an obligation of the caller; what the backend may do meanwhile is the sentence after",
    "So a pair of ranks that both send before they receive": "promises nothing: an obligation of the caller, following from the sentence before",
    "The returned handle is already completed.": "untestable because a completed handle and a pending one whose collective has finished behave alike (wait() returns at once on both); what completion means, the result in the buffer when a synchronous call returns, is the sentence before, checked",
    "The handle keeps the temporaries alive until then.": "untestable because a freed temporary's memory may keep its bytes until it is reused, so no check tells a kept temporary from a freed one",
    "**Hooks receive contiguous tensors only**": "promises nothing: a permission to implementations; the facade's staging that keeps it is the next sentence, checked by the layout cases",
    "The core's own hook implementations (the default plugin's": "untestable because it binds ds_core's own implementations, not the backend under test (tests/test_comm_noncontig.py checks them)",
}


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
def ds_comm_backend_name() -> str:
    """Return the ``torch.distributed`` backend name for this device (``"gloo"``, ...).

    Device context: never.

    Use in backends: required. Facade: ``communication_backend_name()``.
    """


@hookspec(firstresult=True)
@unchecked("Called by ``ds_core.init_distributed`` before", CALLED_BY_CORE)
@unchecked(
    ":raises RuntimeError: naming the missing package",
    "untestable because the suite runs where the backend's process-group library is installed "
    "(selection and init_distributed need it), and removing it is no portable check",
)
def ds_comm_prepare() -> bool:
    """Import whatever registers the backend's process-group library with ``torch.distributed``.

    Called by ``ds_core.init_distributed`` before ``init_process_group``. Idempotent.

    :returns: ``True`` once the comm backend name is usable.
    :raises RuntimeError: naming the missing package when the library is absent.

    Device context: never.

    Use in backends: required (return ``True`` when nothing needs importing).
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
def ds_comm_all_reduce(tensor: torch.Tensor, op: str, group: Any, async_op: bool) -> Work:
    """Reduce ``tensor`` across the group in place, so every rank holds the result.

    :param tensor: the buffer, reduced in place; contiguous (the facade stages a view, see
        Layout above).
    :param op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"product"``.
    :param group: a process group from ``ds_core.comm.new_group``, or ``None`` for the world.
    :param async_op: return before completion; the caller waits on the handle.
    :raises ValueError: on an unknown ``op``; through the facade, on a non-contiguous
        ``tensor`` whose elements may share memory.

    Device context: uses the existing one (the process group already made it).

    Use in backends: optional (core default). Facade: ``all_reduce``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
def ds_comm_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
) -> Work:
    """Gather every rank's ``input`` into ``output``, concatenated along dim 0 in rank order.

    :param output: a contiguous tensor of ``world_size × input.numel()`` elements, filled in
        its row-major element order (the facade stages a view, see Layout above).
    :param input: this rank's contribution, contiguous; the same size on every rank.
    :raises ValueError: when ``output`` has the wrong number of elements; through the
        facade, when ``output`` is non-contiguous with elements that may share memory.

    Device context: uses the existing one (the process group already made it).

    Use in backends: optional (core default). Facade: ``all_gather``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
@unchecked(
    "Implementations may use it as scratch",
    "promises nothing: a permission to the backend, so an obligation of the caller",
)
def ds_comm_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: Any, async_op: bool
) -> Work:
    """Reduce ``input`` across ranks and leave rank ``r``'s ``r``-th equal chunk in ``output``.

    :param output: a contiguous tensor of ``input.numel() / world_size`` elements (the
        facade stages a view, see Layout above).
    :param input: the full buffer, contiguous; its numel is divisible by the group size.
        Implementations may use it as scratch (e.g. an in-place all-reduce), so callers must
        not rely on its contents afterwards (a staged input's scratch is the temporary).
    :param op: as for ``ds_comm_all_reduce``.
    :raises ValueError: when the sizes do not divide; through the facade, when ``output``
        is non-contiguous with elements that may share memory.

    Device context: uses the existing one (the process group already made it).

    Use in backends: optional (core default). Facade: ``reduce_scatter``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
def ds_comm_broadcast(tensor: torch.Tensor, src: int, group: Any, async_op: bool) -> Work:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place.

    :param tensor: the buffer, read on ``src`` and overwritten elsewhere; contiguous (the
        facade stages a view, see Layout above).
    :param src: the source's global rank.
    :raises ValueError: through the facade, when ``tensor`` is non-contiguous with elements
        that may share memory.

    Device context: uses the existing one (the process group already made it).

    Use in backends: optional (core default). Facade: ``broadcast``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
def ds_comm_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
    async_op: bool,
) -> Work:
    """Scatter slices of ``input`` (along dim 0) to every rank and gather theirs into ``output``.

    :param output: the received rows, contiguous (the facade stages a view, see Layout
        above).
    :param input: the rows to send, contiguous.
    :param output_split_sizes: rows received from each rank, or ``None`` for equal splits.
    :param input_split_sizes: rows sent to each rank, or ``None`` for equal splits.
    :raises ValueError: through the facade, when ``output`` is non-contiguous with elements
        that may share memory.

    Device context: uses the existing one (the process group already made it).

    Use in backends: optional (core default). Facade: ``all_to_all``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
def ds_comm_barrier(group: Any) -> bool:
    """Block until every rank of the group has reached the barrier.

    Device context: uses the existing one (the process group already made it).

    Use in backends: optional (core default). Facade: ``barrier``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
@unchecked("Use in backends: gated by ``p2p``", OPTIONAL)
def ds_comm_send(tensor: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Work:
    """Send ``tensor`` to global rank ``dst``, which receives it with ``ds_comm_recv``.

    :param tensor: the data, read (after the work queued on the current stream, as for the
        collectives above) and not modified; contiguous (the facade stages a view).
    :param dst: the receiver's global rank; a member of ``group``, not this rank.
    :param group: a process group from ``ds_core.comm.new_group``, or ``None`` for the world.
    :param tag: matches the receiver's ``tag`` (see Point-to-point above); ``0`` by default
        in the facade.
    :param async_op: return before the data left; the caller keeps ``tensor`` unmodified
        until the handle's ``wait()`` returns.
    :raises RuntimeError: when ``dst`` has exited (through the facade, naming ``dst``).
    :raises ValueError: through the facade, when ``dst`` is this rank or outside the world.

    Device context: uses the existing one (the process group already made it).

    Use in backends: gated by ``p2p`` (core default over ``torch.distributed``). Facade:
    ``send``, ``isend``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
@unchecked("Use in backends: gated by ``p2p``", OPTIONAL)
def ds_comm_recv(tensor: torch.Tensor, src: int, group: Any, tag: int, async_op: bool) -> Work:
    """Receive into ``tensor`` what global rank ``src`` sends with ``ds_comm_send``.

    :param tensor: the buffer, overwritten; the sender's size and dtype; contiguous (the
        facade stages a view).
    :param src: the sender's global rank; a member of ``group``, not this rank.
    :param group: as for ``ds_comm_send``.
    :param tag: the sender's ``tag``.
    :param async_op: return before the data arrived; ``wait()`` makes it visible (see the
        ordering rules above).
    :raises RuntimeError: when ``src`` has exited (through the facade, naming ``src``).
    :raises ValueError: through the facade, when ``src`` is this rank or outside the world,
        or ``tensor`` is non-contiguous with elements that may share memory.

    Device context: uses the existing one (the process group already made it).

    Use in backends: gated by ``p2p`` (core default over ``torch.distributed``). Facade:
    ``recv``, ``irecv``.
    """


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Device context: uses the existing one", USES_CONTEXT)
@unchecked("Use in backends: gated by ``p2p``", OPTIONAL)
@unchecked(
    "Every op of the list names the same group.",
    "promises nothing: an obligation of the caller, not of the backend",
)
def ds_comm_batch_isend_irecv(ops: list[P2POp]) -> list[Work]:
    """Start every send and receive of ``ops`` before waiting for any; one handle per op.

    Two ranks that exchange (each sends to the other and receives from it), or a ring of
    ranks, issue their operations in one batch: an implementation must not let any of them
    wait for one issued later in the list. Every op of the list names the same group.

    :param ops: :class:`ds_core.types.P2POp` records (``"send"`` or ``"recv"``, tensor, global
        peer, group, tag), contiguous tensors (the facade stages views).
    :returns: a handle per op, in the order of ``ops``; each ``wait()`` as for an
        asynchronous ``ds_comm_send`` / ``ds_comm_recv``.
    :raises RuntimeError: when a peer has exited (through the facade, naming it).

    Device context: uses the existing one (the process group already made it).

    Use in backends: gated by ``p2p`` (core default over ``torch.distributed``). Facade:
    ``batch_isend_irecv``.
    """
