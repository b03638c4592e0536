"""The CPU backend's point-to-point hooks: shared memory between two ranks of one host, else gloo.

[Note: p2p channels]
Each ordered pair of ranks of a group has a channel; the two channels of a pair share one
segment (:mod:`ds_backend_cpu.shm_segment`, a two-rank layout), created by the lower global
rank at the pair's first operation. Side ``s`` of the pair (0 for the lower rank) writes its
outgoing messages into its own two data slots, a ring of two chunks, and publishes a count of
chunks written (``_SENT``, a release store in its control block); the peer reads chunk ``c``
from slot ``c % 2`` once that count exceeds ``c`` and publishes how many chunks it has taken
(``_TAKEN``, in its own block). A sender reuses a slot only once the chunk before the previous
one was taken, so a message of any size streams through in slot-sized chunks while the
receiver copies the previous chunk out. Each chunk's slot has a header (message number,
bytes, dtype, tag, element count): the receiver checks the first chunk of each message against
its own call and, on a mismatch, raises naming the field and sets ``_FAILED`` in its block, so
its peer stops too instead of waiting. Messages are matched in issue order per ordered pair,
as ``ds_core/hookspecs/comm.py`` (Point-to-point) requires: each direction is a FIFO.

Setup is a rendezvous of the two ranks only (the other ranks of the group take no part, so it
cannot use the group's collectives): through the process group's key-value store each side
posts its host key, whether it can use shared memory and its pid; both derive the same
decision from the two posts; then the lower rank creates the segment and posts its name, the
higher attaches and posts the outcome, and the name is unlinked. Any failure leaves the pair on
gloo, on both ranks alike, with the reason counted (:func:`ds_backend_cpu.comm.transport_counts`).
A message whose tensor the shared-memory collectives would not carry (the rule of
:func:`ds_backend_cpu.comm.route`) goes over gloo too, decided alike on both sides since both
tensors have the same dtype and device.

Threads: each direction of a pair has its own queue (a
:class:`~ds_backend_cpu.shm_groups.CallQueue`), so a send never waits
behind a receive from the same peer; an asynchronous call (and every op of a batch) is queued
and returns at once, which is how a batch starts every operation before waiting for any. A
synchronous call with nothing queued runs on the caller's thread.

A dead peer: every wait is cut into slices (``LIVENESS_SLICE_S``) between which the peer's pid
is checked, as the collectives do (:class:`ds_backend_cpu.shm.ShmProtocol`), and a send checks
it before writing (a free slot needs no wait, so a message to an exited peer would otherwise
vanish without an error); before the pair has exchanged pids, the pid is taken from any
shared-memory group already set up with that rank (:func:`ds_backend_cpu.shm_groups.known_pid`).
"""

from __future__ import annotations

import array
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ds_backend_cpu import comm, shm, shm_groups, shm_sync
from ds_backend_cpu import shm_segment as seg_mod
from ds_backend_cpu.shm_groups import CallQueue
from ds_core import hookimpl
from ds_core.comm import DefaultCollectives
from ds_core.comm_staging import require_contiguous
from ds_core.types import COMPLETED, P2POp, Work

# Words of each side's control block (a two-rank shm_segment layout has 72 words per block).
# Counters keep the collectives' sleeper distance (the C helper wakes futex sleepers there).
_SENT = seg_mod.COUNTER_WORD  # chunks this side has written into its outgoing slots
_PID = seg_mod.PID_WORD
_SLEEPERS = seg_mod.SLEEPERS_WORD - seg_mod.COUNTER_WORD
_TAKEN = 16  # chunks this side has read from its peer's slots (sleepers at 16 + _SLEEPERS)
_FAILED = 32  # nonzero once this side rejected a message
_HEADER = 40  # one header per outgoing slot, _HEADER_WORDS each
_HEADER_WORDS = 8
_H_MESSAGE, _H_BYTES, _H_DTYPE, _H_TAG, _H_NUMEL = range(5)

_DEFAULT = DefaultCollectives()
_STORE_PREFIX = "ds_cpu_p2p"


class Pair:
    """This rank's end of the channels to one peer in one group (see [Note: p2p channels]).

    :param pg: the process group (held weakly).
    :param me: this rank's global rank.
    :param peer: the peer's global rank.
    """

    def __init__(self, pg: Any, me: int, peer: int) -> None:
        self._pg = weakref.ref(pg)
        self._group_name = str(getattr(pg, "group_name", "") or "")
        self.me, self.peer = me, peer
        self.side = 0 if me < peer else 1
        self.timeout = shm.timeout_s(shm_groups._group_timeout(pg))
        self.lanes = {
            "send": CallQueue(f"ds_core-shm-p2p-{me}to{peer}"),
            "recv": CallQueue(f"ds_core-shm-p2p-{peer}to{me}"),
        }
        self.reason = ""  # why the pair uses gloo, once set up
        self.set_up = False
        self.broken: shm.ShmError | None = None
        self.segment: seg_mod.Segment | None = None
        self._flags: shm_sync.Flags | None = None
        self._lock = threading.Lock()
        self.peer_pid = 0
        self._sent = self._taken = 0  # chunks written / read so far
        self._out = self._in = 0  # messages sent / received so far
        self._words: dict[tuple[int, int], int] = {}

    # ---------------------------------------------------------------- setup

    def ready(self, what: str) -> bool:
        """Set the pair up on its first operation (either direction, either thread).

        :returns: whether the pair uses shared memory (else ``reason`` says why not).
        :raises ShmPeerError: when the peer exited or never arrived.
        """
        with self._lock:
            if self.broken is not None:
                raise shm.ShmPeerError(
                    f"shared-memory {what}: the channel with rank {self.peer} is unusable after "
                    f"an earlier failure: {self.broken}"
                )
            if not self.set_up:
                try:
                    self.reason = self._handshake(what)
                except shm.ShmError as exc:
                    self.broken = exc
                    raise
                self.set_up = True
            return self._flags is not None

    def _handshake(self, what: str) -> str:
        store = dist.distributed_c10d._get_default_store()
        lo, hi = sorted((self.me, self.peer))
        key = f"{_STORE_PREFIX}/{self._group_name}/{lo}-{hi}/"
        local = "" if shm_groups.enabled() else f"{shm_groups.ENV_ENABLE}=0"
        local = local or shm_sync.unavailable_reason()
        store.set(f"{key}facts{self.side}", json.dumps([seg_mod.host_key(), local, os.getpid()]))
        theirs = json.loads(self._get(store, f"{key}facts{1 - self.side}", what))
        self.peer_pid = int(theirs[2])
        mine = (seg_mod.host_key(), local)
        facts = [mine, theirs] if self.side == 0 else [theirs, mine]
        for rank, (_host, reason, *_pid) in zip((lo, hi), facts, strict=True):
            if reason:
                return f"rank {rank}: {reason}"
        if facts[0][0] != facts[1][0]:
            return f"ranks {lo} and {hi} are on different hosts"
        segment: seg_mod.Segment | None = None
        if self.side == 0:
            layout = seg_mod.Layout(2, shm_groups.slot_bytes())
            try:
                segment = seg_mod.create(layout)
                announce = f"{segment.path}\n{layout.slot_bytes}"
            except seg_mod.SegmentError as exc:
                announce = f"error: {exc}"
            store.set(f"{key}segment", announce)
            if segment is None:
                return f"rank {lo}: {announce.removeprefix('error: ')}"
            try:
                problem = self._get(store, f"{key}attached", what).decode()
            finally:
                segment.unlink()  # attached, or given up: the name can go
            if problem:
                return f"rank {hi}: {problem}"
        else:
            announce = self._get(store, f"{key}segment", what).decode()
            if announce.startswith("error: "):
                return f"rank {lo}: {announce.removeprefix('error: ')}"
            path, slot = announce.split("\n")
            problem = ""
            try:
                segment = seg_mod.attach(path, seg_mod.Layout(2, int(slot)))
            except seg_mod.SegmentError as exc:
                problem = str(exc)
            store.set(f"{key}attached", problem)
            if problem:
                return f"rank {hi}: {problem}"
        assert segment is not None
        flags = shm_sync.choose_flags(segment.words, segment.address(), _SLEEPERS)
        if flags is None:  # pragma: no cover - both sides reported a synchronisation path
            return shm_sync.unavailable_reason()
        self.segment, self._flags = segment, flags
        for side in (0, 1):
            for word in (_SENT, _PID, _TAKEN, _FAILED, _HEADER):
                self._words[(side, word)] = segment.word_index(side, word)
        flags.store(self._words[(self.side, _PID)], os.getpid())
        return ""

    def _get(self, store: Any, key: str, what: str) -> bytes:
        """``store[key]`` once the peer posted it, checking between polls that it lives."""
        deadline = time.monotonic() + self.timeout
        pause = 1e-3
        while not store.check([key]):
            pid = self.peer_pid or shm_groups.known_pid(self.peer)
            if pid and not shm_sync.pid_alive(pid):
                raise shm.ShmPeerError(
                    f"shared-memory {what}: rank {self.peer} (pid {pid}) exited before it set "
                    f"up point-to-point with rank {self.me}"
                )
            if time.monotonic() > deadline:
                raise shm.ShmPeerError(
                    f"shared-memory {what}: rank {self.peer} made no point-to-point call with "
                    f"rank {self.me} on this group within {self.timeout:g} s (the group's "
                    f"timeout, or {shm.ENV_TIMEOUT})"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        value: bytes = store.get(key)
        return value

    # ---------------------------------------------------------------- messages

    def _wait(self, side: int, word: int, target: int, what: str) -> None:
        """Wait until the word reaches ``target``; raise naming the peer if it died or failed."""
        assert self._flags is not None
        index = self._words[(side, word)]
        deadline = time.monotonic() + self.timeout
        while self._flags.wait_all([index], target, shm.LIVENESS_SLICE_S) >= 0:
            error: shm.ShmError | None = None
            if self._flags.load(self._words[(1 - self.side, _FAILED)]):
                error = shm.ShmMismatchError(
                    f"shared-memory {what}: rank {self.peer} rejected message "
                    f"#{self._out} from rank {self.me} (its own error says why)"
                )
            elif not shm_sync.pid_alive(self.peer_pid):
                error = shm.ShmPeerError(
                    f"shared-memory {what}: rank {self.peer} (pid {self.peer_pid}) exited "
                    f"while rank {self.me} waited for it"
                )
            elif time.monotonic() > deadline:
                error = shm.ShmPeerError(
                    f"shared-memory {what}: rank {self.peer} did not take part within "
                    f"{self.timeout:g} s (the group's timeout, or {shm.ENV_TIMEOUT}); it is "
                    f"alive, so it is elsewhere (this is rank {self.me})"
                )
            if error is not None:
                self.broken = error
                raise error

    def send(self, data: torch.Tensor, numel: int, dtype: int, tag: int) -> None:
        """Stream ``data`` (contiguous bytes, 1-D uint8) to the peer, in slot-sized chunks."""
        assert self.segment is not None and self._flags is not None
        seg, what = self.segment, f"send to rank {self.peer}"
        if not shm_sync.pid_alive(self.peer_pid):
            # A free slot needs no wait, so without this a message to an exited peer would
            # vanish: the spec makes it an error (ds_core/hookspecs/comm.py, Point-to-point).
            self.broken = shm.ShmPeerError(
                f"shared-memory {what}: rank {self.peer} (pid {self.peer_pid}) has exited "
                f"(this is rank {self.me})"
            )
            raise self.broken
        size, n = seg.slot_bytes, data.numel()
        self._out += 1
        header = array.array("Q", [self._out, n, dtype, tag & (2**64 - 1), numel, 0, 0, 0])
        for i in range(max(1, -(-n // size))):
            c = self._sent
            if c >= 2:  # slot c % 2 is free once the peer took chunk c - 2
                self._wait(1 - self.side, _TAKEN, c - 1, what)
            start = seg.layout.slot_offset(self.side, c % 2)
            m = min(size, n - i * size)
            seg.bytes[start : start + m].copy_(data[i * size : i * size + m])
            h = self._words[(self.side, _HEADER)] + (c % 2) * _HEADER_WORDS
            seg.words[h : h + _HEADER_WORDS] = memoryview(header)
            self._sent = c + 1
            self._flags.store(self._words[(self.side, _SENT)], c + 1)

    def recv(self, data: torch.Tensor, numel: int, dtype: int, tag: int) -> None:
        """Receive the peer's next message into ``data`` (contiguous bytes, 1-D uint8).

        :raises ShmMismatchError: naming the field when the message differs from this call.
        """
        assert self.segment is not None and self._flags is not None
        seg, what = self.segment, f"recv from rank {self.peer}"
        size, n, peer_side = seg.slot_bytes, data.numel(), 1 - self.side
        self._in += 1
        for i in range(max(1, -(-n // size))):
            c = self._taken
            self._wait(peer_side, _SENT, c + 1, what)
            if i == 0:
                h = self._words[(peer_side, _HEADER)] + (c % 2) * _HEADER_WORDS
                self._check(list(seg.words[h : h + _HEADER_WORDS]), n, numel, dtype, tag)
            start = seg.layout.slot_offset(peer_side, c % 2)
            m = min(size, n - i * size)
            data[i * size : i * size + m].copy_(seg.bytes[start : start + m])
            self._taken = c + 1
            self._flags.store(self._words[(self.side, _TAKEN)], c + 1)

    def _check(self, header: list[int], n: int, numel: int, dtype: int, tag: int) -> None:
        assert self._flags is not None
        mine = {_H_MESSAGE: self._in, _H_BYTES: n, _H_DTYPE: dtype, _H_NUMEL: numel,
                _H_TAG: tag & (2**64 - 1)}  # fmt: skip
        names = {_H_MESSAGE: "message number", _H_BYTES: "bytes", _H_DTYPE: "dtype",
                 _H_NUMEL: "numel", _H_TAG: "tag"}  # fmt: skip
        for field in (_H_MESSAGE, _H_DTYPE, _H_NUMEL, _H_BYTES, _H_TAG):
            if header[field] != mine[field]:
                theirs, ours = str(header[field]), str(mine[field])
                if field == _H_DTYPE:
                    known = 0 < header[field] <= len(shm.DTYPES)
                    theirs = str(shm.DTYPES[header[field] - 1]) if known else theirs
                    ours = str(shm.DTYPES[mine[field] - 1])
                error = shm.ShmMismatchError(
                    f"shared-memory recv from rank {self.peer}: its message #{self._in} has "
                    f"{names[field]}={theirs}, but rank {self.me} posted a receive with "
                    f"{names[field]}={ours}"
                )
                self.broken = error
                self._flags.store(self._words[(self.side, _FAILED)], 1)
                raise error

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()


# --------------------------------------------------------------------------- registry

_pairs: weakref.WeakKeyDictionary[Any, dict[int, Pair]] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def pair(group: Any, peer: int, what: str) -> Pair:
    """This rank's channel end to global rank ``peer`` in ``group`` (set up on first use).

    :raises ValueError: naming ``peer`` when it is this rank or not a member of the group, or
        when this rank is not a member.
    """
    pg = shm_groups.resolve(group)
    with _registry_lock:
        peers = _pairs.get(pg)
        if peers is None:
            peers = _pairs[pg] = {}
            weakref.finalize(pg, _close_all, peers)
        found = peers.get(peer)
        if found is None:
            ranks = list(dist.get_process_group_ranks(pg))
            me = dist.get_rank()
            if me not in ranks:
                raise ValueError(f"{what}: this rank ({me}) is not a member of the group {ranks}")
            if peer not in ranks or peer == me:
                raise ValueError(
                    f"{what}: peer {peer} must be another global rank of the group {ranks}"
                )
            found = peers[peer] = Pair(pg, me, peer)
    return found


def _close_all(peers: dict[int, Pair]) -> None:
    for end in list(peers.values()):
        end.close()


def pairs(group: Any) -> dict[int, Pair]:
    """The channels set up so far on ``group``, by peer (for tests and reports)."""
    with _registry_lock:
        return dict(_pairs.get(shm_groups.resolve(group), {}))


def _gloo_call(kind: str) -> Callable[..., Work]:
    return _DEFAULT.ds_comm_send if kind == "send" else _DEFAULT.ds_comm_recv


def _start(
    kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int, async_op: bool
) -> Work:
    what = f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}"
    end = pair(group, peer, what)
    lane = end.lanes[kind]
    reason = comm._tensor_reason([tensor])
    gloo = reason or (end.reason if end.set_up else "")
    if gloo and lane.idle():
        comm._gloo(kind, gloo)
        return _gloo_call(kind)(tensor, peer, group, tag, async_op)
    # Otherwise queued behind this direction's earlier messages (never waiting for them here:
    # an asynchronous call must return while the peer has not yet received them).
    data = tensor.detach().reshape(-1).view(torch.uint8) if not reason else tensor
    numel, dtype = tensor.numel(), 0 if reason else shm.DTYPES.index(tensor.dtype) + 1
    move = end.send if kind == "send" else end.recv

    def call() -> None:
        if reason:
            comm._gloo(kind, reason)
            _gloo_call(kind)(tensor, peer, group, tag, False)
        elif end.ready(what):
            comm._count(kind, "shm", "")
            move(data, numel, dtype, tag)
        else:
            comm._gloo(kind, end.reason)
            _gloo_call(kind)(tensor, peer, group, tag, False)

    work = lane.submit(call, async_op)
    return work if async_op else COMPLETED


# --------------------------------------------------------------------------- hooks


@hookimpl
def ds_comm_send(tensor: torch.Tensor, dst: int, group: Any, tag: int, async_op: bool) -> Work:
    require_contiguous("send", tensor=tensor)
    return _start("send", tensor, dst, group, tag, async_op)


@hookimpl
def ds_comm_recv(tensor: torch.Tensor, src: int, group: Any, tag: int, async_op: bool) -> Work:
    require_contiguous("recv", tensor=tensor)
    return _start("recv", tensor, src, group, tag, async_op)


@hookimpl
def ds_comm_batch_isend_irecv(ops: list[P2POp]) -> list[Work]:
    for op in ops:
        require_contiguous(f"batch_isend_irecv {op.op}", tensor=op.tensor)
    if any(op.group is not ops[0].group for op in ops):
        raise ValueError("batch_isend_irecv: every P2POp must name the same group")
    # Every op is queued on its direction's lane before any is waited for (the hookspec).
    return [_start(op.op, op.tensor, op.peer, op.group, op.tag, True) for op in ops]
