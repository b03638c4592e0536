"""Collectives through a shared-memory segment, for process groups whose ranks share a host.

[Note: protocol]
Each rank owns an arrival counter in the segment and bumps it once per *step*: publish the
counter (release store), then wait until every peer's counter reaches the same value (acquire
loads); what a rank wrote before publishing is then visible to every peer. Data moves in
*pieces* of at most one slot: write my part into my slot of parity ``piece % 2``, step, read
the peers' slots (an all-reduce takes one more step between "each rank reduces its own region
in place" and "everyone copies every region out"). Why alternating slots need no step after
the reads: a rank writes parity ``p`` again only at piece ``t+2``, and before that it waited, in
piece ``t+1``'s first step, for every peer to publish, which a peer does only after it finished
reading piece ``t``. An all-reduce of at most ``SMALL_BYTES`` takes a single step: every rank
reduces the whole buffer from all slots, in rank order, so every rank gets the same bits.

Every call's first step also publishes a metadata record (collective, dtype, element counts,
op, root, shape, group, all-to-all rows, and whether this rank's arguments failed a local
check); each rank compares every peer's record with its own, and the whole matrix of
all-to-all rows, so a mismatch is seen by every rank at the same step and each raises a
:class:`ShmMismatchError` naming the rank and field. Records alternate by call parity, so a
fast peer's next record never overwrites one still being read.

Buffers larger than a slot go through in pieces; each rank reduces only its region of each
piece (an all-reduce region is 1/world of the piece, a reduce-scatter region is this rank's
output chunk), so the reduction work is split evenly and nothing is reduced twice. A rank
copies into its slot only the regions its peers reduce and reads its own region straight from
its buffer. An all-reduce rank so copies (2 world - 1) / world of the piece (its peers'
regions in and out, its own result out to them) besides reducing 1/world of it: 1.5x the
piece on 2 ranks, against 2x when every rank copied its whole piece in.
"""

from __future__ import annotations

import array
import hashlib
import os
import time
from collections.abc import Callable, Sequence

import torch

from ds_backend_cpu import shm_segment as seg_mod
from ds_backend_cpu.shm_sync import Flags, pid_alive

ENV_TIMEOUT = "DS_CPU_SHM_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
LIVENESS_SLICE_S = 0.1

KINDS = ("barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)
OPS = ("", "sum", "avg", "max", "min", "product")
MAX_DIMS = 8
# All-reduces up to this size take one step, each rank reducing the whole buffer.
SMALL_BYTES = 64 << 10
# A broadcast moves in at least this many pieces (each at least MIN_PIECE bytes), to pipeline.
BROADCAST_SPLIT = 4
MIN_PIECE = 1 << 20

# Record words (after the record's base). Unused fields stay 0 on every rank.
_SEQ, _KIND, _DTYPE, _NUMEL, _NUMEL2, _OP, _ROOT, _ROW, _GROUP, _ERROR, _NDIM, _SHAPE = range(12)
_FIELDS = ("call", "collective", "dtype", "numel", "output numel", "op", "root", "row elements",
           "group", "argument check", "ndim")  # fmt: skip


class ShmError(RuntimeError):
    """A shared-memory collective failed; the message names the rank(s) involved."""


class ShmMismatchError(ShmError, ValueError):
    """Ranks called a collective with different arguments; the message names the field."""


class ShmPeerError(ShmError):
    """A peer died or did not arrive within the timeout; the group cannot be used again."""


def group_hash(ranks: Sequence[int]) -> int:
    digest = hashlib.blake2b(repr(tuple(ranks)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def timeout_s(group_timeout: float | None) -> float:
    """Seconds a call waits for a live peer: ``DS_CPU_SHM_TIMEOUT``, else the process group's
    own timeout (what ``init_distributed(timeout=...)`` set), else 300."""
    value = os.environ.get(ENV_TIMEOUT)
    if value:
        return float(value)
    return group_timeout if group_timeout else DEFAULT_TIMEOUT_S


_REDUCE_OUT: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
    "product": torch.mul,
}


def _reduce_into(out: torch.Tensor, parts: Sequence[torch.Tensor], op: str) -> None:
    """``out = parts[0] op parts[1] op ...``, in that order (``out`` may alias ``parts[0]``)."""
    fn = _REDUCE_OUT[op]
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    fn(parts[0], parts[1], out=out)
    for part in parts[2:]:
        fn(out, part, out=out)


class ShmProtocol:
    """The step protocol of one group over one segment (runs on one thread at a time).

    :param segment: the mapped segment.
    :param flags: the synchronisation path.
    :param rank: this rank's index in the group.
    :param ranks: the group's global ranks, in group order (for messages).
    :param group_timeout: the process group's timeout in seconds, if known.
    """

    def __init__(
        self,
        segment: seg_mod.Segment,
        flags: Flags,
        rank: int,
        ranks: Sequence[int],
        group_timeout: float | None = None,
    ) -> None:
        self.seg, self.flags, self.rank, self.ranks = segment, flags, rank, list(ranks)
        self.world = len(ranks)
        self.group = group_hash(ranks)
        self.step = 0  # value of this rank's counter: steps published so far
        self.calls = 0
        self.pieces = 0  # data pieces moved so far; its parity picks the slots
        self.timeout = timeout_s(group_timeout)
        self.broken: ShmPeerError | None = None
        lay = segment.layout
        self._counter = [segment.word_index(r, seg_mod.COUNTER_WORD) for r in range(self.world)]
        self._peers = [self._counter[r] for r in range(self.world) if r != rank]
        self._peer_ranks = [r for r in range(self.world) if r != rank]
        self._pids = [0] * self.world
        self._record_words = lay.record_words

    # ---------------------------------------------------------------- setup and steps

    def publish_pid(self) -> None:
        self.flags.store(self.seg.word_index(self.rank, seg_mod.PID_WORD), os.getpid())

    def read_pids(self) -> None:
        self._pids = [
            self.flags.load(self.seg.word_index(r, seg_mod.PID_WORD)) for r in range(self.world)
        ]

    def pid_of(self, global_rank: int) -> int:
        """The pid global rank ``global_rank`` published at setup (0 when not a member)."""
        return self._pids[self.ranks.index(global_rank)] if global_rank in self.ranks else 0

    def _record_index(self, rank: int, call: int) -> int:
        base = seg_mod.RECORD_WORD + (call % 2) * self._record_words
        return self.seg.word_index(rank, base)

    def _sync(self, what: str) -> None:
        """Publish the next step and wait for every peer to publish it too."""
        self.step += 1
        self.flags.store(self._counter[self.rank], self.step)
        deadline = time.monotonic() + self.timeout
        pending = self._peers
        while True:
            first = self.flags.wait_all(pending, self.step, LIVENESS_SLICE_S)
            if first < 0:
                return
            pending = pending[first:]
            peers = [self._peer_ranks[self._peers.index(i)] for i in pending]
            dead = [r for r in peers if not pid_alive(self._pids[r])]
            if dead or time.monotonic() > deadline:
                self.broken = self._peer_error(what, dead, peers)
                raise self.broken

    def _peer_error(self, what: str, dead: list[int], late: list[int]) -> ShmPeerError:
        def who(r: int) -> str:
            return f"rank {self.ranks[r]} (pid {self._pids[r]})"

        me = f"rank {self.ranks[self.rank]}"
        if dead:
            return ShmPeerError(
                f"shared-memory {what}: {', '.join(who(r) for r in dead)} exited while {me} "
                f"waited for it in call #{self.calls} on this group"
            )
        return ShmPeerError(
            f"shared-memory {what}: {', '.join(who(r) for r in late)} did not reach call "
            f"#{self.calls} on this group within {self.timeout:g} s (the group's timeout, or "
            f"{ENV_TIMEOUT}); it is alive, so it is elsewhere, e.g. in another collective "
            f"(this is {me})"
        )

    def begin(self, kind: str, fields: dict[int, int], shape: Sequence[int], error: str,
              rows: tuple[Sequence[int], Sequence[int]] | None = None) -> None:  # fmt: skip
        """Write this call's record, run its first step, and check every peer's record.

        :param error: a local argument problem ("" if none); it is raised here, after the
            peers learnt of it, so they fail with a message naming this rank instead of
            waiting for it.
        :raises ShmMismatchError: naming the first field where a peer's call differs.
        """
        if self.broken is not None:
            raise ShmPeerError(f"this group is unusable after an earlier failure: {self.broken}")
        self.calls += 1
        rec = [0] * self._record_words
        rec[_SEQ], rec[_KIND], rec[_GROUP] = self.calls, KINDS.index(kind) + 1, self.group
        rec[_ERROR] = 1 if error else 0
        for k, v in fields.items():
            rec[k] = v
        if len(shape) <= MAX_DIMS:
            rec[_NDIM] = len(shape) + 1
            rec[_SHAPE : _SHAPE + len(shape)] = list(shape)
        if rows is not None:
            w = self.world
            rec[seg_mod.META_WORDS : seg_mod.META_WORDS + w] = list(rows[0])
            rec[seg_mod.META_WORDS + w : seg_mod.META_WORDS + 2 * w] = list(rows[1])
        base = self._record_index(self.rank, self.calls)
        self.seg.words[base : base + len(rec)] = memoryview_of(rec)
        self._sync(kind)
        records = []
        for r in range(self.world):
            b = self._record_index(r, self.calls)
            records.append(list(self.seg.words[b : b + self._record_words]))
        if error:
            raise ValueError(error)
        self._check(kind, records)

    def _check(self, kind: str, records: list[list[int]]) -> None:
        mine = records[self.rank]
        for r, theirs in enumerate(records):
            if r == self.rank:
                continue
            who = f"rank {self.ranks[r]}"
            if theirs[_ERROR]:
                raise ShmMismatchError(
                    f"shared-memory {kind}: {who} rejected its arguments (its own error says "
                    "why); this rank stops too"
                )
            if theirs[: seg_mod.META_WORDS] == mine[: seg_mod.META_WORDS]:
                continue
            for i in range(seg_mod.META_WORDS):
                if theirs[i] != mine[i]:
                    raise ShmMismatchError(
                        f"shared-memory {kind}: {who} posted {self._field(i, theirs)}, but this "
                        f"rank ({self.ranks[self.rank]}) has {self._field(i, mine)}"
                    )
        if kind == "all_to_all":
            w, m = self.world, seg_mod.META_WORDS
            for src in range(w):
                for dst in range(w):
                    sent, expected = records[src][m + dst], records[dst][m + w + src]
                    if sent != expected:
                        raise ShmMismatchError(
                            f"shared-memory all_to_all: rank {self.ranks[src]} sends {sent} rows "
                            f"to rank {self.ranks[dst]}, which expects {expected}"
                        )

    @staticmethod
    def _field(i: int, rec: list[int]) -> str:
        if i == _KIND:
            return f"collective={KINDS[rec[i] - 1] if 0 < rec[i] <= len(KINDS) else rec[i]}"
        if i == _DTYPE:
            return f"dtype={DTYPES[rec[i] - 1] if 0 < rec[i] <= len(DTYPES) else rec[i]}"
        if i == _OP:
            return f"op={OPS[rec[i]] if rec[i] < len(OPS) else rec[i]}"
        if i == _ROOT:
            return f"root={rec[i] - 1}"
        if i >= _NDIM:
            n = rec[_NDIM] - 1
            return f"shape={tuple(rec[_SHAPE : _SHAPE + n]) if n >= 0 else 'more than 8 dims'}"
        return f"{_FIELDS[i]}={rec[i]}"

    # ---------------------------------------------------------------- collectives

    def _next_slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The data slots of the next piece: parities alternate per piece, on every rank alike."""
        self.pieces += 1
        return self.seg.slots(self.pieces % 2, dtype)

    def _cap(self, dtype: torch.dtype, nbytes: int = 0) -> int:
        """Elements of ``dtype`` in ``nbytes`` (default: one slot)."""
        return (nbytes or self.seg.slot_bytes) // torch.empty((), dtype=dtype).element_size()

    def barrier(self) -> None:
        self.begin("barrier", {}, (), "")

    def all_reduce(self, flat: torch.Tensor, op: str, shape: Sequence[int]) -> None:
        """Reduce ``flat`` (contiguous, 1-D) in place across the group."""
        w, me, n = self.world, self.rank, flat.numel()
        cap = self._cap(flat.dtype)
        fields = {_DTYPE: DTYPES.index(flat.dtype) + 1, _NUMEL: n, _OP: OPS.index(op)}
        if n * flat.element_size() <= SMALL_BYTES and n <= cap:
            # One step instead of two: every rank reduces the whole (small) buffer itself, in
            # rank order, so all get the same bits; the second step would cost more than this.
            slots = self._next_slots(flat.dtype)
            slots[me, :n].copy_(flat)
            self.begin("all_reduce", fields, shape, "")
            _reduce_into(flat, [slots[r, :n] for r in range(w)], op)
            if op == "avg":
                flat.div_(w)
            return
        for i, start in enumerate(range(0, max(n, 1), cap)):
            m = min(cap, n - start)
            piece = flat[start : start + m]
            bounds = [m * r // w for r in range(w + 1)]
            slots = self._next_slots(flat.dtype)
            # Only the regions the peers reduce go through my slot; my own region is read
            # from the buffer itself (a copy of 1/world of the piece saved).
            for r in self._peer_ranks:
                slots[me, bounds[r] : bounds[r + 1]].copy_(piece[bounds[r] : bounds[r + 1]])
            if i == 0:
                self.begin("all_reduce", fields, shape, "")
            else:
                self._sync("all_reduce")
            lo, hi = bounds[me], bounds[me + 1]
            parts = [piece[lo:hi] if r == me else slots[r, lo:hi] for r in range(w)]
            # Rank order for every region, so the bits do not depend on who reduced it; the
            # result goes into my slot's own (so far unused) region, where the peers copy it.
            mine = slots[me, lo:hi]
            _reduce_into(mine, parts, op)
            if op == "avg":
                mine.div_(w)
            piece[lo:hi].copy_(mine)
            self._sync("all_reduce")
            for r in self._peer_ranks:
                piece[bounds[r] : bounds[r + 1]].copy_(slots[r, bounds[r] : bounds[r + 1]])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, error: str,
                       shape: Sequence[int]) -> None:  # fmt: skip
        """Reduce ``inp`` (1-D, world x n) and leave chunk ``rank`` in ``out`` (1-D, n)."""
        w, me, n = self.world, self.rank, out.numel()
        cap = self._cap(inp.dtype) // w
        fields = {_DTYPE: DTYPES.index(inp.dtype) + 1, _NUMEL: inp.numel(), _NUMEL2: n,
                  _OP: OPS.index(op)}  # fmt: skip
        rows = inp.view(w, n) if not error else inp
        # My own chunk is read from the input itself unless the output overlaps the input
        # (an in-place reduce-scatter), where reading it after writing out could be wrong.
        direct = not error and not _overlaps(out, inp)
        senders = self._peer_ranks if direct else range(w)
        for i, start in enumerate(range(0, max(n, 1), cap)):
            m = min(cap, n - start)
            slots = self._next_slots(inp.dtype)
            if not error:
                for r in senders:
                    slots[me, r * m : (r + 1) * m].copy_(rows[r, start : start + m])
            if i == 0:
                self.begin("reduce_scatter", fields, shape, error)
            else:
                self._sync("reduce_scatter")
            mine = slice(me * m, (me + 1) * m)
            parts = [
                rows[me, start : start + m] if r == me and direct else slots[r, mine]
                for r in range(w)
            ]
            dst = out[start : start + m]
            _reduce_into(dst, parts, op)
            if op == "avg":
                dst.div_(w)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, error: str,
                   shape: Sequence[int]) -> None:  # fmt: skip
        """Gather every rank's ``inp`` (1-D, n) into ``out`` (1-D, world x n) in rank order."""
        w, me, n = self.world, self.rank, inp.numel()
        cap = self._cap(inp.dtype)
        fields = {_DTYPE: DTYPES.index(inp.dtype) + 1, _NUMEL: n, _NUMEL2: out.numel()}
        # The usual in-place form: the input is this rank's own chunk of the output.
        in_place = not error and inp.data_ptr() == out.data_ptr() + me * n * inp.element_size()
        for i, start in enumerate(range(0, max(n, 1), cap)):
            m = min(cap, n - start)
            slots = self._next_slots(inp.dtype)
            slots[me, :m].copy_(inp[start : start + m])
            if i == 0:
                self.begin("all_gather", fields, shape, error)
            else:
                self._sync("all_gather")
            rows = out.view(w, n)[:, start : start + m]
            if in_place:  # my row already holds my input: copy only the peers' rows
                for r in self._peer_ranks:
                    rows[r].copy_(slots[r, :m])
            else:
                rows.copy_(slots[:, :m])

    def broadcast(self, flat: torch.Tensor, root: int, shape: Sequence[int]) -> None:
        """Copy group rank ``root``'s ``flat`` to every rank."""
        me, n = self.rank, flat.numel()
        # Pieces of at most 1/BROADCAST_SPLIT of the buffer: the root copies piece k+1 into the
        # other parity's slot while the peers copy piece k out, so the two copies overlap
        # instead of following each other.
        cap = min(
            self._cap(flat.dtype), max(-(-n // BROADCAST_SPLIT), self._cap(flat.dtype, MIN_PIECE))
        )
        fields = {_DTYPE: DTYPES.index(flat.dtype) + 1, _NUMEL: n, _ROOT: root + 1}
        for i, start in enumerate(range(0, max(n, 1), cap)):
            m = min(cap, n - start)
            slots = self._next_slots(flat.dtype)
            if me == root:
                slots[me, :m].copy_(flat[start : start + m])
            if i == 0:
                self.begin("broadcast", fields, shape, "")
            else:
                self._sync("broadcast")
            if me != root:
                flat[start : start + m].copy_(slots[root, :m])

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, send: Sequence[int],
                   recv: Sequence[int], row: int, error: str) -> None:  # fmt: skip
        """Send ``send[d]`` rows of ``inp`` to each rank ``d``; receive ``recv[s]`` into ``out``.

        ``inp`` and ``out`` are 1-D; a row is ``row`` elements. A metadata-only first step lets
        every rank derive the same number of pieces from the whole send matrix.
        """
        w, me = self.world, self.rank
        fields = {_DTYPE: DTYPES.index(inp.dtype) + 1, _ROW: row}
        self.begin("all_to_all", fields, (), error, rows=(send, recv))
        biggest = 0
        for r in range(w):
            b = self._record_index(r, self.calls) + seg_mod.META_WORDS
            biggest = max(biggest, max(self.seg.words[b : b + w]))
        per = max(self._cap(inp.dtype) // w, 1)
        send_at = [sum(send[:d]) * row for d in range(w)]
        recv_at = [sum(recv[:s]) * row for s in range(w)]
        for start in range(0, biggest * row, per):
            slots = self._next_slots(inp.dtype)
            for d in range(w):
                m = max(min(per, send[d] * row - start), 0)
                if m:
                    at = send_at[d] + start
                    slots[me, d * per : d * per + m].copy_(inp[at : at + m])
            self._sync("all_to_all")
            for s in range(w):
                m = max(min(per, recv[s] * row - start), 0)
                if m:
                    at = recv_at[s] + start
                    out[at : at + m].copy_(slots[s, me * per : me * per + m])


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def memoryview_of(values: list[int]) -> memoryview:
    return memoryview(array.array("Q", values))
