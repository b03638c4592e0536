"""Collectives on 2 and 4 real ranks over the backend's comm library, checked locally.

One group of rank processes per world size runs every case (see :mod:`comm_cases`, shared
with the ZeRO smoke test through :mod:`ds_conformance.ranks`); the tests below report each
case. Ranks are processes on the ``cpu`` device type; elsewhere a world size needs that many
devices, else its cases skip. Cases whose id contains ``late-`` check blocking semantics with
a late peer; ``stream-`` cases check stream ordering (``async_streams`` backends only);
``strided`` and ``transposed`` cases pass non-contiguous views (``comm_cases.LAYOUTS``).
A peer that exits is checked on a 3-rank group of its own (:mod:`comm_dead_peer`).
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_conformance.comm_cases import Case, cases
from ds_conformance.comm_dead_peer import SCENARIOS as DEAD_PEER_SCENARIOS
from ds_conformance.marks import capability, hooks, promise, tier
from ds_conformance.ranks import RankGroups

pytestmark = tier("multi-rank")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        from ds_conformance.plugin import suite_of

        collective = metafunc.function.__name__.removeprefix("test_")
        chosen = [
            pytest.param(c, id=c.id, marks=[capability(c.capability)] if c.capability else [])
            for c in cases(suite_of(metafunc.config).acc.supported_dtypes())
            if c.collective == collective
        ]
        metafunc.parametrize("case", chosen)


def _result(acc: Any, groups: RankGroups, case: Case) -> None:
    __tracebackhide__ = True
    groups.result(acc, case.world, case.key)


@hooks("ds_comm_all_reduce", "ds_comm_prepare", "ds_comm_backend_name")
@promise(
    "ds_comm_all_reduce",
    "Reduce ``tensor`` across the group in place, so every rank holds the result.",
)
@promise("ds_comm_all_reduce", ":param tensor: the buffer, reduced in place")
@promise("ds_comm_all_reduce", ':param op: ``"sum"``')
@promise("ds_comm_all_reduce", ":param group: a process group from")
@promise("ds_comm_all_reduce", ":param async_op: return before completion")
@promise(
    "comm", "Tensors are on the backend's device; all ranks of the group call the same collective"
)
@promise("comm", "Collectives take a process group from ``ds_core.comm.new_group``")
@promise("comm", "A synchronous collective blocks while any peer has not joined.")
@promise("comm", "the hook returns without waiting for peers.")
@promise("comm", "``handle.wait()`` orders completion before later work")
@promise("comm", "Ordered after the current stream at call time.")
@promise("comm", "A staged call is exact.")
@promise(
    "comm", "A non-contiguous in-place buffer or output is written only through its own elements"
)
@promise("comm", "The facade (and so ``ds_core.comm``) gives callers any strided tensor")
@promise("comm", "``wait()`` may be called more than once; later calls do nothing.")
@promise("comm", "Collectives on different groups may be in flight at once")
@promise("comm", "without ``async_streams`` (synchronous devices, the host) it returns")
@promise("comm", "Either way, work queued after ``wait()`` sees the result")
@promise("stream", "A collective runs after the stream current when it is called")
@promise("ds_comm_all_reduce", ":raises ValueError: on an unknown ``op``")
@promise("comm", "**An in-place buffer or output whose elements may share memory**")
def test_all_reduce(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_all_gather")
@promise(
    "ds_comm_all_gather",
    "Gather every rank's ``input`` into ``output``, concatenated along dim 0 in rank order.",
)
@promise(
    "ds_comm_all_gather",
    ":param output: a contiguous tensor of ``world_size × input.numel()`` elements",
)
@promise("ds_comm_all_gather", ":param input: this rank's contribution")
@promise("ds_comm_all_gather", ":raises ValueError: when ``output`` has the wrong number")
@promise("comm", "An input may share memory.")
def test_all_gather(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_reduce_scatter")
@promise("ds_comm_reduce_scatter", "Reduce ``input`` across ranks and leave rank")
@promise(
    "ds_comm_reduce_scatter",
    ":param output: a contiguous tensor of ``input.numel() / world_size`` elements",
)
@promise("ds_comm_reduce_scatter", ":param op: as for ``ds_comm_all_reduce``.")
@promise(
    "ds_comm_reduce_scatter",
    ":param input: the full buffer, contiguous; its numel is divisible by the group size.",
)
@promise("ds_comm_reduce_scatter", ":raises ValueError: when the sizes do not divide")
def test_reduce_scatter(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_broadcast")
@promise(
    "ds_comm_broadcast",
    "Copy ``tensor`` from global rank ``src`` to every rank of the group, in place.",
)
@promise("ds_comm_broadcast", ":param src: the source's global rank.")
@promise(
    "ds_comm_broadcast", ":param tensor: the buffer, read on ``src`` and overwritten elsewhere"
)
@promise("ds_comm_broadcast", ":raises ValueError: through the facade")
def test_broadcast(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_all_to_all")
@promise(
    "ds_comm_all_to_all",
    "Scatter slices of ``input`` (along dim 0) to every rank and gather theirs into ``output``.",
)
@promise(
    "ds_comm_all_to_all",
    ":param output_split_sizes: rows received from each rank, or ``None`` for equal splits.",
)
@promise(
    "ds_comm_all_to_all",
    ":param input_split_sizes: rows sent to each rank, or ``None`` for equal splits.",
)
@promise("ds_comm_all_to_all", ":param output: the received rows")
@promise("ds_comm_all_to_all", ":param input: the rows to send, contiguous.")
@promise("ds_comm_all_to_all", ":raises ValueError: through the facade")
def test_all_to_all(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_send", "ds_comm_recv", "ds_comm_batch_isend_irecv")
@promise(
    "ds_comm_send",
    "Send ``tensor`` to global rank ``dst``, which receives it with ``ds_comm_recv``.",
)
@promise(
    "ds_comm_recv", "Receive into ``tensor`` what global rank ``src`` sends with ``ds_comm_send``."
)
@promise(
    "ds_comm_batch_isend_irecv",
    "Start every send and receive of ``ops`` before waiting for any; one handle per op.",
)
@promise(
    "ds_comm_batch_isend_irecv",
    "Two ranks that exchange (each sends to the other and receives from it), or a ring of ranks, issue their operations in one batch",
)
@promise("ds_comm_batch_isend_irecv", ":returns: a handle per op, in the order of ``ops``")
@promise("ds_comm_recv", ":param async_op: return before the data arrived")
@promise("ds_comm_send", ":param dst: the receiver's global rank")
@promise("ds_comm_recv", ":param src: the sender's global rank")
@promise("comm", "**Peers are global ranks**")
@promise("comm", "**Matching is per ordered pair, in issue order.**")
@promise("ds_comm_send", ":param tensor: the data, read (after the work queued")
@promise("ds_comm_recv", ":param tensor: the buffer, overwritten")
@promise("ds_comm_batch_isend_irecv", ":param ops: :class:`ds_core.types.P2POp` records")
@promise("ds_comm_send", ":param async_op: return before the data left")
@promise("ds_comm_send", ":param tag: matches the receiver's ``tag``")
@promise("ds_comm_recv", ":param tag: the sender's ``tag``.")
@promise("ds_comm_send", ":raises ValueError: through the facade, when ``dst`` is this rank")
@promise("ds_comm_recv", ":raises ValueError: through the facade, when ``src`` is this rank")
@promise("ds_comm_send", ":param group: a process group from ``ds_core.comm.new_group``")
@promise("ds_comm_recv", ":param group: as for ``ds_comm_send``.")
@promise("comm", "a synchronous receive returns once the data is in the buffer")
@promise(
    "comm",
    "Point-to-point (``ds_comm_send``, ``ds_comm_recv``, ``ds_comm_batch_isend_irecv``; since hook version 2",
)
def test_p2p(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_barrier")
@promise("ds_comm_barrier", "Block until every rank of the group has reached the barrier.")
def test_barrier(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_backend_name")
@promise("ds_comm_backend_name", "Return the ``torch.distributed`` backend name for this device")
@promise("ds_comm_prepare", ":returns: ``True`` once the comm backend name is usable.")
@promise("ds_comm_prepare", "Idempotent.")
@promise(
    "ds_comm_prepare",
    "Import whatever registers the backend's process-group library with ``torch.distributed``.",
)
def test_backend_name_is_a_torch_distributed_backend(acc: Any) -> None:
    import torch.distributed as dist

    name = acc.communication_backend_name()
    prepared = [acc.prepare_communication(), acc.prepare_communication()]  # idempotent
    if prepared != [True, True]:
        pytest.fail(
            f"prepare_communication() twice returned {prepared}, but should return True each "
            "time [ds_comm_prepare]",
            pytrace=False,
        )
    known = {b.lower() for b in dist.Backend.backend_list} | {
        b.lower() for b in getattr(dist.Backend, "_plugins", {})
    }
    if name.lower() not in known:
        pytest.fail(
            f"communication_backend_name()={name!r}, but should be one of {sorted(known)} after ds_comm_prepare [ds_comm_backend_name]",
            pytrace=False,
        )


@hooks("ds_comm_send", "ds_comm_recv", "ds_comm_batch_isend_irecv")
@capability("p2p")
@promise("comm", "**A dead peer is an error, not a hang.**")
@promise("ds_comm_send", ":raises RuntimeError: when ``dst`` has exited")
@promise("ds_comm_recv", ":raises RuntimeError: when ``src`` has exited")
@promise("ds_comm_batch_isend_irecv", ":raises RuntimeError: when a peer has exited")
@pytest.mark.parametrize("dead_peer", list(DEAD_PEER_SCENARIOS))
def test_a_dead_peer_is_an_error_not_a_hang(
    acc: Any, rank_groups: RankGroups, dead_peer: str
) -> None:
    """Rank 2 of 3 exits; rank 0's send, receive or batch with it on a subgroup ``[0, 2]``
    must raise ``RuntimeError`` naming rank 2 and the operation, not hang
    (:mod:`ds_conformance.comm_dead_peer`)."""
    rank_groups.dead_peer_result(acc, dead_peer)
