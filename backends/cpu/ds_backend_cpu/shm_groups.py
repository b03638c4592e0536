"""One shared-memory transport per process group: setup, and an ordered queue of calls.

Setup runs as part of the group's first collective, on every rank of it (they all make that
call), in call order on whichever thread runs that call:
one gloo all-gather decides whether the group qualifies (every rank on this host, shared
memory enabled and a synchronisation path available on each), the first rank creates the
segment and broadcasts its name, the others attach, one more all-gather confirms every attach
and the name is unlinked (see [Note: segment lifetime] in :mod:`ds_backend_cpu.shm_segment`).
Any failure leaves the group on gloo, on every rank alike, with the reason recorded.
Those setup calls go through a :class:`Handshake`: over a registered process group by
default, or (:class:`BackendHandshake`) over a bare c10d backend object that
``torch.distributed`` does not know, such as the private gloo group the sim backend's
``simccl`` queues its traffic on; that is how another backend uses this transport as a library.

Calls on a group run in the order they were made: a synchronous call with nothing queued runs
on the caller's thread; otherwise calls go to the group's worker thread, whose handle's
``wait()`` returns when the call is done and re-raises its error. The handle keeps the
tensors alive until then.
"""

from __future__ import annotations

import os
import pickle
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_cpu import shm_segment as seg_mod
from ds_backend_cpu import shm_sync
from ds_backend_cpu.shm import ShmProtocol

ENV_ENABLE = "DS_CPU_SHM"
ENV_SLOT = "DS_CPU_SHM_SLOT_BYTES"
DEFAULT_SLOT_BYTES = 4 << 20
SINGLE_RANK = "single-rank group"


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "1").lower() not in ("0", "false", "off", "no")


def slot_bytes() -> int:
    value = int(os.environ.get(ENV_SLOT, DEFAULT_SLOT_BYTES))
    return max(value // 64 * 64, 4096)


class ShmWork:
    """Handle of a queued call: ``wait()`` blocks until it ran and re-raises its error."""

    __slots__ = ("_done", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn  # holds the tensors until the call ran
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            if self._fn is not None:
                self._fn()
        except BaseException as exc:  # re-raised on the waiting thread
            self._error = exc
        finally:
            self._fn = None
            self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class CallQueue:
    """Calls that run one at a time, in issue order, on the caller's thread when nothing is
    queued and the call is synchronous, else on one worker thread (started on first use).

    A process group's collectives (:class:`ShmGroup`) and each direction of a point-to-point
    pair (``shm_p2p``) each own one: later calls never overtake earlier ones, and an
    asynchronous call returns at once.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[ShmWork] = deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None], async_op: bool) -> ShmWork:
        """Run ``fn`` after every earlier call; wait for it unless ``async_op``."""
        work = ShmWork(fn)
        with self._cond:
            inline = not async_op and not self._queue and not self._busy
            if inline:
                self._busy = True
            else:
                self._queue.append(work)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        if inline:
            try:
                work.run()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        if not async_op:
            work.wait()
        return work

    def idle(self) -> bool:
        """Whether no call is queued or running."""
        with self._cond:
            return not self._queue and not self._busy

    def drain(self) -> None:
        """Block until every queued call has run."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def close(self) -> None:
        """Stop the worker once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._busy:
                    if self._closed and not self._queue:
                        return
                    self._cond.wait()
                work = self._queue.popleft()
                self._busy = True
            try:
                work.run()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class ShmGroup:
    """The transport of one process group on this rank: its protocol and its call queue.

    Created without talking to the peers; the first call run on the group (in call order,
    on the caller's thread or the worker's) sets it up, so an asynchronous first call does
    not wait for its peers either. Afterwards ``protocol`` is set, or ``reason`` says why the
    group uses gloo.
    """

    def __init__(self, pg: Any, handshake: Handshake | None = None) -> None:
        self._pg = weakref.ref(pg)  # never keep a process group alive
        # How setup talks to the peers: over ``pg`` as a registered group unless given.
        self._handshake = handshake
        self.protocol: ShmProtocol | None = None
        self.reason = ""
        self._set_up = False
        self._calls = CallQueue("ds_core-shm-collectives")

    def ready(self) -> ShmProtocol | None:
        """Set the group up if this is its first call (run only from a call on this group).

        :returns: the protocol, or ``None`` when the group uses gloo (``reason`` says why).
        """
        if not self._set_up:
            self._set_up = True
            pg = self._pg()
            try:
                if pg is None:
                    result: ShmProtocol | str = "the process group was destroyed"
                else:
                    result = _setup(self._handshake or Handshake(pg))
            except BaseException as exc:
                self.reason = f"setup failed ({type(exc).__name__}: {exc})"
                raise
            if isinstance(result, str):
                self.reason = result
            else:
                self.protocol = result
        return self.protocol

    def close(self) -> None:
        """Stop the worker once the queue is empty (the group object is gone: no more calls).

        The mapping goes with the last reference to this object.
        """
        self._calls.close()

    def submit(self, fn: Callable[[], None], async_op: bool) -> ShmWork:
        """Run ``fn`` after every earlier call on this group; wait for it unless ``async_op``."""
        return self._calls.submit(fn, async_op)

    def drain(self) -> None:
        """Block until every queued call has run (before a gloo call on the same group)."""
        self._calls.drain()


# --------------------------------------------------------------------------- registry

# group object -> its transport, or the reason it stays on gloo. Weak keys: a process group
# must not outlive destroy_process_group because of this cache.
_groups: weakref.WeakKeyDictionary[Any, ShmGroup | str] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def resolve(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def lookup(group: Any) -> ShmGroup | str:
    """The group's transport (set up by its first call); a string is why it uses gloo.

    Never talks to the peers.
    """
    pg = resolve(group)
    with _registry_lock:
        found = _groups.get(pg)
        if found is None:
            if dist.get_rank(pg) < 0:
                found = "this process is not a member of the group"
            elif dist.get_world_size(pg) < 2:
                found = SINGLE_RANK
            else:
                found = ShmGroup(pg)
                weakref.finalize(pg, found.close)
            _groups[pg] = found
    return found


def existing(group: Any) -> ShmProtocol | None:
    """The group's shared-memory protocol if it is set up already (never sets one up)."""
    found = _groups.get(resolve(group))
    return found.protocol if isinstance(found, ShmGroup) else None


def known_pid(rank: int) -> int:
    """The pid of global rank ``rank`` as published in a shared-memory group set up here that
    includes it, else 0 (point-to-point channels check a peer's liveness with it before they
    exchanged pids themselves: ``ds_backend_cpu.shm_p2p``)."""
    with _registry_lock:
        found = list(_groups.values())
    for g in found:
        if isinstance(g, ShmGroup) and g.protocol is not None:
            pid = g.protocol.pid_of(rank)
            if pid:
                return pid
    return 0


def _group_timeout(pg: Any) -> float | None:
    """The gloo backend's timeout for ``pg`` in seconds (a private attribute: best effort)."""
    try:
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:
        return None


class Handshake:
    """The group-wide calls setup makes, over a process group ``torch.distributed`` knows."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.rank: int = dist.get_rank(pg)
        #: the group's global ranks in group order (messages and the protocol's group hash)
        self.ranks: list[int] = list(dist.get_process_group_ranks(pg))
        self.timeout = _group_timeout(pg)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Group rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.pg)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.pg)


class BackendHandshake(Handshake):
    """The same calls over a bare c10d backend object (e.g. a ``ProcessGroupGloo`` built from
    a store) that is not registered with ``torch.distributed``; objects travel pickled.

    :param backend: the backend; its ``rank()`` is this rank's index in the group.
    :param ranks: names of the group's ranks, in group order, for messages.
    :param timeout: the backend's timeout in seconds, if known.
    """

    def __init__(self, backend: Any, ranks: Sequence[int], timeout: float | None) -> None:
        self.pg = backend
        self.rank = int(backend.rank())
        self.ranks = list(ranks)
        self.timeout = timeout

    def all_gather_object(self, obj: Any) -> list[Any]:
        world = len(self.ranks)
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        self.pg.allgather([parts], [padded]).wait()
        return [
            pickle.loads(p[: int(s)].numpy().tobytes()) for p, s in zip(parts, sizes, strict=True)
        ]

    def broadcast_object(self, obj: Any) -> Any:
        return self.all_gather_object(obj if self.rank == 0 else None)[0]

    def barrier(self) -> None:
        self.pg.barrier().wait()


def _setup(h: Handshake) -> ShmProtocol | str:
    rank, ranks = h.rank, h.ranks
    world = len(ranks)
    local_reason = ""
    if not enabled():
        local_reason = f"{ENV_ENABLE}=0"
    else:
        local_reason = shm_sync.unavailable_reason()
    facts = h.all_gather_object((seg_mod.host_key(), local_reason))
    for r, (key, reason) in enumerate(facts):
        if reason:
            return f"rank {ranks[r]}: {reason}"
        if key != facts[0][0]:
            return f"ranks {ranks[0]} and {ranks[r]} are on different hosts"
    layout = seg_mod.Layout(world, slot_bytes())
    segment: seg_mod.Segment | None = None
    announce: list[Any] = [None]
    if rank == 0:
        try:
            segment = seg_mod.create(layout)
            announce = [segment.path]
        except seg_mod.SegmentError as exc:
            announce = [f"error: {exc}"]
    announce = [h.broadcast_object(announce[0])]
    problem = ""
    if announce[0].startswith("error: "):
        problem = announce[0].removeprefix("error: ")
    elif segment is None:
        try:
            segment = seg_mod.attach(announce[0], layout)
        except seg_mod.SegmentError as exc:
            problem = str(exc)
    try:
        outcomes = h.all_gather_object(problem)
    finally:
        if segment is not None:
            segment.unlink()  # every rank is attached (or gave up): the name can go
    for r, outcome in enumerate(outcomes):
        if outcome:
            return f"rank {ranks[r]}: {outcome}"
    if segment is None:  # pragma: no cover - every rank reported success above
        return "segment missing after setup"
    flags = shm_sync.choose_flags(
        segment.words, segment.address(), seg_mod.SLEEPERS_WORD - seg_mod.COUNTER_WORD
    )
    if flags is None:  # pragma: no cover - checked before the all-gather
        return shm_sync.unavailable_reason()
    protocol = ShmProtocol(segment, flags, rank, ranks, h.timeout)
    protocol.publish_pid()
    h.barrier()  # every pid is published before anyone reads them
    protocol.read_pids()
    return protocol
