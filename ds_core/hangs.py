"""Hang checks: ranks whose calls disagree are named, not left to the transport's timeout
(docs/architecture.md §3.10).

A hang between live ranks (a rank skipped ``step()``, ran another count of micro-batches,
issued a collective the others did not, or left the run early) is found by comparing what
each rank *issued*. The training thread only counts: every collective entering the facade
(:class:`ds_core.facade.Accelerator`) appends ``(seq, op, numel, dtype)`` to a short ring of
its channel (:func:`note`, one ``deque.append``: atomic in CPython, so autograd threads may
issue too) -- no store request, no stack walk per call. A channel is a process group (keyed
by its member ranks and torch's group name, which every rank derives alike) or, for
point-to-point, an ordered ``(src, dst)`` pair: pipeline schedules order sends and receives
differently per rank, so only each pair's own order must agree.

The liveness watchdog (:mod:`ds_core.comm.liveness`) does the rest on its own thread and
store connection, once a period:

- :meth:`Checker.tick` samples the main thread's innermost frame: unchanged (same frame,
  same instruction, no call issued) since the last period means *stalled*; a stack
  inside a collective, a ``torch.distributed`` call or with a frame on a ``.wait(`` line is
  *in communication*, where only a new call counts as progress (a backend's wait may poll
  in Python, moving its frame without getting anywhere); stalled there is *blocked*. On a
  device with ``async_streams`` a collective runs on a stream, not in the call: the host
  waits for it later, in whatever synchronises with that stream (a ``.item()``, a copy to the
  host), whose frame is not a collective's. There a main thread whose own code (frames
  outside the backend's ``ds_backend_*`` modules, which may run queued work and poll) is
  stalled counts as blocked too, *waiting on the device*: its peers' records then tell
  whether its pending work includes a call a peer has not issued (below), or it computes. It
  publishes this rank's record (``prog/<rank>``: per channel the issued count and ring, the
  stall, its phase, the engine's step) -- one store
  request per period.
- A rank blocked for ``misses`` periods reads its peers' records and decides:

  * the same call number on a channel holds another op, size or dtype on a peer: a
    *mismatch*, reported at once;
  * a peer issued fewer calls on the channel this rank waits on and is itself blocked:
    the wait-for chain is followed across records; a *cycle* is a deadlock, reported at
    once;
  * a peer that left the run (``destroy_distributed``) after fewer calls: reported at once
    (also after the watchdog stood down, from the leaver's last record, without the store);
  * a peer behind that is not blocked (it computes, or waits on someone computing): only
    after :attr:`Settings.timeout_s` of this rank's stall;
  * every member issued the call this rank waits in: the transport is slow or broken,
    which is liveness's business, not this check's.

The first rank to decide publishes the verdict in liveness's verdict key; every rank prints
one line -- ``ds_core: <what disagrees, naming ranks, calls, phases>; this rank is R;
exiting`` -- runs the abort cleanups and exits with :data:`EXIT_CODE`.

Settings (environment, read when the watchdog starts): ``DS_HANG_CHECK`` (``0`` turns it
off) and ``DS_HANG_TIMEOUT_S`` (default 600 s: a peer may compute or write a checkpoint for
minutes while others wait, so this bound only ends what is surely stuck, still well before
the process group's timeout of 30 min). DeepSpeed 0.19.8 has no such check to follow (its
``runtime/engine.py`` trusts every rank to issue the same calls), hence the names.
"""

from __future__ import annotations

import itertools
import json
import linecache
import os
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ds_core.errors import ConfigError

#: exit status of a rank ended by a hang verdict (EX_SOFTWARE: the program's ranks disagree;
#: liveness's 75 means a peer died instead).
EXIT_CODE = 70
#: calls kept per channel for the mismatch check.
RING = 16
#: ops whose element count legitimately differs between ranks (uneven splits).
_ANY_SIZE = frozenset({"all_to_all"})
_CALL = re.compile(
    r"\.(all_reduce|all_gather|reduce_scatter|broadcast|all_to_all|barrier|send|recv|"
    r"batch_isend_irecv|wait|synchronize)\("
)
_TORCH_C10D = "torch.distributed.distributed_c10d"
_WAIT = re.compile(r"\.(wait|synchronize)\(")
#: the facade's communication methods (also liveness's phase names for them)
COMM_FUNCS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
        "barrier",
        "send",
        "recv",
        "batch_isend_irecv",
    }
)


@dataclass(frozen=True, slots=True)
class Settings:
    """The hang check's settings.

    :param enabled: whether calls are counted and compared.
    :param timeout_s: seconds this rank may wait on a peer that is behind and not blocked
        (it computes) before the run is ended.
    """

    enabled: bool = True
    timeout_s: float = 600.0

    @classmethod
    def from_env(cls, bound_s: float) -> Settings:
        """Read ``DS_HANG_CHECK`` and ``DS_HANG_TIMEOUT_S``.

        :param bound_s: liveness's bound (period times misses): the timeout must exceed it.
        :raises ConfigError: a value not understood or out of range, naming it and the fix.
        """
        flag = os.environ.get("DS_HANG_CHECK", "1").strip().lower()
        if flag not in ("0", "1", "true", "false", "on", "off"):
            raise ConfigError(f"DS_HANG_CHECK={flag!r}: expected 1/0 (on/off, true/false)")
        text = os.environ.get("DS_HANG_TIMEOUT_S", "600")
        try:
            timeout = float(text)
        except ValueError:
            timeout = -1.0
        if not timeout > bound_s:
            raise ConfigError(
                f"DS_HANG_TIMEOUT_S={text!r}: expected seconds above the liveness bound "
                f"({bound_s:g} s = DS_LIVENESS_PERIOD_S x DS_LIVENESS_MISSES)"
            )
        return cls(flag in ("1", "true", "on"), timeout)


def _no_group() -> None:
    return None


class _Channel:
    __slots__ = ("count", "group", "key", "members", "ring")

    def __init__(self, key: str, members: list[int], group: Callable[[], Any]) -> None:
        # ``group``: a weak reference to the group object (a cached id may be reused by a
        # later group; a strong one would keep a destroyed group alive past finalization)
        self.key, self.members, self.group = key, members, group
        self.count = itertools.count()
        self.ring: deque[tuple[int, str, int | None, str, int]] = deque(maxlen=RING)


_UNNAMED = ""
_channels: dict[Any, _Channel] = {}
_order = itertools.count()  # issue order across channels: which call came last
_on = True


def _channel(group: Any) -> _Channel:
    import torch.distributed as dist

    ref = _no_group if group is None else weakref.ref(group)
    if group is None or group is dist.group.WORLD:
        world = _channels.get("world")
        if world is None:
            members = list(range(dist.get_world_size()))
            world = _channels["world"] = _Channel("world", members, _no_group)
        ch = _Channel("world", world.members, ref)
        ch.count, ch.ring = world.count, world.ring  # one sequence, whichever name is used
    else:
        members = sorted(dist.get_process_group_ranks(group))
        try:
            name = str(group.group_name)
        except (AttributeError, RuntimeError):  # "ProcessGroup name not set": members alone
            name = ""
        # without a name ranks cannot tell two groups of the same members apart: such a
        # group is counted but neither published nor compared
        key = f"group {members} ({name})" if name else _UNNAMED
        ch = _Channel(key, members, ref)
    _channels[id(group)] = ch
    return ch


def note(op: str, group: Any, numel: int | None, dtype: Any) -> None:
    """Count one collective entering the facade (a no-op when the check is off)."""
    if not _on:
        return
    ch = _channels.get(id(group))
    if ch is None or ch.group() is not group:
        ch = _channel(group)
    ch.ring.append((next(ch.count), op, numel, str(dtype), next(_order)))


def note_p2p(op: str, peer: int, numel: int, dtype: Any) -> None:
    """Count one send (``op="send"``) to or receive from global rank ``peer``."""
    if not _on:
        return
    ch = _channels.get((op, peer))
    if ch is None:
        import torch.distributed as dist

        me = dist.get_rank()
        src, dst = (me, peer) if op == "send" else (peer, me)
        ch = _channels[(op, peer)] = _Channel(f"p2p {src}->{dst}", [src, dst], _no_group)
    ch.ring.append((next(ch.count), op, numel, str(dtype), next(_order)))


def forget() -> None:
    """Drop every channel (``destroy_distributed``: group ids may be reused)."""
    _channels.clear()


def engine_progress(engine: Any) -> str:
    """``step S, micro-batch M of N`` for a ZeRO (or pipeline) engine: what :func:`track`
    names by default."""
    gas = engine.gas
    return f"step {engine.global_steps + 1}, micro-batch {engine.micro_steps % gas + 1} of {gas}"


_context: tuple[weakref.ref[Any], Callable[[Any], str]] | None = None


def track(engine: Any, describe: Callable[[Any], str] = engine_progress) -> None:
    """Name ``describe(engine)`` (its step, micro-batch) in this rank's record; weakly held."""
    global _context
    _context = (weakref.ref(engine), describe)


def _describe() -> str:
    if _context is None:
        return ""
    engine = _context[0]()
    try:
        return _context[1](engine) if engine is not None else ""
    except Exception:  # read from another thread mid-update: leave it out
        return ""


def snapshot() -> dict[str, list[Any]]:
    """This rank's channels: key -> [members, issued, ring of [seq, op, numel, dtype]]."""
    out: dict[str, list[Any]] = {}
    for ch in list(_channels.values()):
        ring = list(ch.ring)
        if ch.group is not _no_group and ch.group() is None:
            continue  # its group is gone
        if ring and ch.key and ch.key not in out:
            out[ch.key] = [ch.members, ring[-1][0] + 1, [list(e[:4]) for e in ring]]
    return out


def _last_call() -> tuple[str, int, str] | None:
    best: tuple[int, str, int, str] | None = None
    for ch in list(_channels.values()):
        if ch.ring and ch.key:
            seq, op, _, _, order = ch.ring[-1]
            if best is None or order > best[0]:
                best = (order, ch.key, seq, op)
    return None if best is None else best[1:]


def _in_comm(frame: FrameType | None) -> bool:
    top = frame
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        name = frame.f_code.co_name
        if module == "ds_core.facade" and name in COMM_FUNCS:
            return True
        if module == _TORCH_C10D:
            return True
        # A handle's wait anywhere on the stack, not only innermost: a backend's handle may
        # wait in Python (the cpu backend's shared-memory wait polls in slices) below it.
        if frame is not top and _WAIT.search(_line(frame)):
            return True
        frame = frame.f_back
    return top is not None and _calls_comm(top)


def _line(frame: FrameType) -> str:
    # A frame read from another thread may have no line yet (``f_lineno`` is None while the
    # interpreter sets a call up: seen during imports).
    lineno = frame.f_lineno
    return "" if lineno is None else linecache.getline(frame.f_code.co_filename, lineno)


def _calls_comm(frame: FrameType) -> bool:
    """Whether ``frame``'s current line calls a collective, a wait or a synchronize: where a
    backend's handle (a C call, no Python frame of its own) blocks or raises."""
    return _CALL.search(_line(frame)) is not None


def raised_in_comm(phase: str, frames: list[FrameType]) -> bool:
    """Whether an exception (its traceback's ``frames``, innermost first, and their
    ``phase``) came out of communication: the transport's error, not the program's."""
    if in_comm_phase(phase):
        return True
    for frame in frames:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("torch.distributed", "ds_backend_")):
            return True
    return bool(frames) and _calls_comm(frames[0])


def _where(record: dict[str, Any]) -> str:
    found = [record[k] for k in ("phase", "ctx") if record.get(k)]
    return "; ".join(found) or "no known phase"


class Checker:
    """One rank's side of the check, driven by the liveness watchdog's thread."""

    def __init__(self, watchdog: Any, settings: Settings, device_waits: bool = False) -> None:
        """:param device_waits: whether the host may wait for communication outside a
        collective's call (a device with ``async_streams``: the liveness watchdog asks the
        accelerator)."""
        self.w, self.settings = watchdog, settings
        self.device_waits = device_waits
        self.rank = watchdog.rank
        self.sample: tuple[Any, ...] | None = None
        self.stalled_since = time.monotonic()
        self.left: dict[int, dict[str, Any]] = {}  # rank -> its last record, once it left
        self.misreads = 0  # periods in a row whose record could not be read

    def record(self, now: float, left: bool = False) -> dict[str, Any]:
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        last = _last_call()
        comm = _in_comm(frame)
        # Inside communication only a new call counts as progress: a wait that polls moves
        # its frame every sample without getting anywhere. On an async device the same holds
        # for a backend running queued work (a collective) inside a device wait.
        own = _own_frame(frame) if self.device_waits else frame
        mark = ("comm", last) if comm else (id(own), own.f_lasti if own else -1, last)
        if mark != self.sample:  # the main thread moved, or some thread issued a call
            self.stalled_since = now
        self.sample = mark
        stall = now - self.stalled_since
        rec: dict[str, Any] = {"ch": snapshot(), "stall": stall, "ctx": _describe()}
        if left:
            rec["left"] = True
            exc = sys.exc_info()[1]
            if isinstance(exc, Exception):
                rec["raised"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        bound = self.w.settings.misses * self.w.settings.period_s
        if stall >= bound or left:
            rec["phase"] = self.w.main_phase()
            # stalled on an async device: a wait for the device, whose queued work may hold a
            # collective (decide() asks the peers; never one on a rank that issued none)
            device = not comm and self.device_waits and last is not None and not left
            rec["comm"] = comm or device
            if device:
                rec["device"] = True
            if last is not None and _in_facade(frame):
                rec["blocked"] = list(last)  # a synchronous call: the last one issued
        return rec

    def tick(self, now: float) -> None:
        """Publish this rank's record; when blocked long enough, decide (may end the process).
        A record that cannot be read this period (the main thread's frames change under the
        reading thread) skips the period: the caller takes any exception from here for the
        store's, and would end the run naming its host."""
        try:
            rec = self.record(now)
        except Exception as exc:
            self._misread(exc)
            return
        self.misreads = 0
        self.w.store.set(self.w.ns + f"prog/{self.rank}", json.dumps(rec))
        bound = self.w.settings.misses * self.w.settings.period_s
        if rec["stall"] >= bound and rec.get("comm"):
            text = self.decide(rec)
            if text is not None:
                self.publish(text)

    def _misread(self, exc: Exception) -> None:
        self.misreads += 1
        if self.misreads == self.w.settings.misses:  # once per streak, not every period
            print(
                f"ds_core: rank {self.rank}: the hang check could not read this rank's state for "
                f"{self.misreads} periods ({type(exc).__name__}: {exc}); it goes on trying",
                file=sys.stderr,
                flush=True,
            )

    def publish(self, text: str) -> None:
        try:
            verdict = json.dumps({"hang": text, "by": self.rank})
            self.w.store.compare_set(self.w.ns + "verdict", "", verdict)  # the first one holds
        except Exception:
            pass  # the others decide for themselves
        self.w._abort({"hang": text})

    def _records(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        keys = [self.w.ns + f"prog/{r}" for r in ranks]
        present = [k for k in keys if self.w.store.check([k])]
        found = self.w.store.multi_get(present) if present else []
        return {
            int(k.rsplit("/", 1)[1]): json.loads(bytes(v))
            for k, v in zip(present, found, strict=True)
        }

    def decide(self, mine: dict[str, Any]) -> str | None:
        """The verdict text, or ``None`` while waiting is still legitimate."""
        peers = sorted({m for ch in mine["ch"].values() for m in ch[0]} - {self.rank})
        recs = self._records(peers)
        recs[self.rank] = mine
        text = _mismatch(self.rank, recs)
        if text is not None:
            return text
        # Follow the wait-for chain from this rank across records (fetched as needed).
        path, rank = [self.rank], self.rank
        while True:
            waits = _waits_on(rank, recs)
            if not waits:
                return None  # everyone issued it: the transport's (and liveness's) business
            peer, key, seq, op = waits[0]
            if peer not in recs:
                recs.update(self._records([peer]))
            rec = recs.get(peer)
            if rec is not None and rec.get("left"):
                return _left_text(peer, rec, rank, recs[rank], key, seq, op)
            blocked = rec is not None and rec.get("comm") and rec["stall"] >= self._bound()
            if blocked and rec is not None and rec.get("device") and not self._waiting(peer, recs):
                blocked = False  # a device wait with no call missing on a peer: it computes
            if blocked and peer in path:
                return _cycle_text(path[path.index(peer) :], recs)
            if not blocked:
                if mine["stall"] < self.settings.timeout_s:
                    return None
                have = rec["ch"].get(key, [[], 0])[1] if rec else "?"
                return (
                    f"rank {peer} has not issued call #{seq} ({op}) on {key} for "
                    f"{mine['stall']:.0f} s (it issued {have}; it is in "
                    f"{_where(rec or {})}), while rank {rank} waits in "
                    f"{_where(recs[rank])} (DS_HANG_TIMEOUT_S={self.settings.timeout_s:g})"
                )
            path.append(peer)
            rank = peer

    def _waiting(self, rank: int, recs: dict[int, dict[str, Any]]) -> bool:
        """Whether ``rank`` waits on a peer (fetching the records that tells it)."""
        members = {m for ch in recs[rank]["ch"].values() for m in ch[0]}
        missing = sorted(members - recs.keys() - {rank})
        if missing:
            recs.update(self._records(missing))
        return bool(_waits_on(rank, recs))

    def mismatch_now(self) -> str | None:
        """The mismatch check alone, on the records as published now (this rank's is)."""
        mine = self.record(time.monotonic())
        mine["phase"] = self.w.phase or mine.get("phase") or self.w.main_phase()
        self.w.store.set(self.w.ns + f"prog/{self.rank}", json.dumps(mine))
        peers = sorted({m for ch in mine["ch"].values() for m in ch[0]} - {self.rank})
        recs = self._records(peers)
        recs[self.rank] = mine
        return _mismatch(self.rank, recs)

    def _bound(self) -> float:
        return float(self.w.settings.misses * self.w.settings.period_s)

    def read_leavers(self) -> None:
        """On seeing that a rank left: keep the last record of each that did (store still up)."""
        try:
            recs = self._records([r for r in range(self.w.world) if r != self.rank])
        except Exception:
            return
        self.left = {r: rec for r, rec in recs.items() if rec.get("left")}

    def ahead_of_leavers(self) -> str | None:
        """Without the store: a call of this rank on a channel with a rank that left, beyond
        the leaver's last (it can never complete)."""
        if not self.left:
            return None
        mine = self.record(time.monotonic(), left=False)
        mine["phase"] = mine.get("phase") or self.w.main_phase()
        for peer, rec in self.left.items():
            for key, (members, issued, ring) in mine["ch"].items():
                if peer not in members or len(members) < 2:
                    continue
                theirs = rec["ch"].get(key, [members, 0, []])[1]
                if issued > theirs:
                    op = next((e[1] for e in ring if e[0] == theirs), "?")
                    return _left_text(peer, rec, self.rank, mine, key, theirs, op)
        return None


def in_comm_phase(phase: str) -> bool:
    """Whether a phase (:func:`ds_core.comm.liveness.phase_of`) is inside communication."""
    return phase.startswith("torch.distributed.") or phase.split(" ", 1)[0] in COMM_FUNCS


def _own_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside a backend's modules: what the program itself is at while a
    backend runs queued device work (and polls) under it."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ds_backend_"):
        frame = frame.f_back
    return frame


def _in_facade(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__") == "ds_core.facade" and (
            frame.f_code.co_name in COMM_FUNCS
        ):
            return True
        frame = frame.f_back
    return False


def _waits_on(rank: int, recs: dict[int, dict[str, Any]]) -> list[tuple[int, str, int, str]]:
    """(peer, channel, call number, op) that ``rank`` waits for: peers that have not issued
    its blocked call (or, blocked in a wait of unknown call, are behind on any channel)."""
    rec = recs[rank]
    chans = rec["ch"]
    blocked = rec.get("blocked")
    if blocked is not None:
        key, seq, op = blocked
        candidates = [(key, seq, op)]
    else:
        candidates = [(k, c[1] - 1, c[2][-1][1]) for k, c in chans.items() if c[2]]
    out = []
    for key, seq, op in candidates:
        for peer in chans[key][0]:
            if peer == rank:
                continue
            other = recs.get(peer)
            have = other["ch"].get(key, [[], 0])[1] if other is not None else None
            if have is None or have <= seq:
                out.append((peer, key, seq, op))
    return out


def _mismatch(me: int, recs: dict[int, dict[str, Any]]) -> str | None:
    for key, (members, _, ring) in recs[me]["ch"].items():
        p2p = key.startswith("p2p")
        for peer in members:
            other = recs.get(peer)
            if peer == me or other is None or key not in other["ch"]:
                continue
            theirs = {e[0]: e for e in other["ch"][key][2]}
            for seq, op, numel, dtype in ring:
                e = theirs.get(seq)
                if e is None:
                    continue
                same_op = p2p or e[1] == op
                sized = op not in _ANY_SIZE and e[1] not in _ANY_SIZE
                if same_op and (not sized or e[2] == numel) and e[3] == dtype:
                    continue
                return (
                    f"ranks disagree at call #{seq} on {key}: rank {me} issued {op} of "
                    f"{numel} {dtype} (now in {_where(recs[me])}), rank {peer} issued {e[1]} "
                    f"of {e[2]} {e[3]} (now in {_where(other)})"
                )
    return None


def _left_text(
    peer: int, rec: dict[str, Any], rank: int, mine: dict[str, Any], key: str, seq: int, op: str
) -> str:
    have = rec["ch"].get(key, [[], 0])[1]
    why = f" while {rec['raised']} propagated" if rec.get("raised") else ""
    return (
        f"rank {peer} left the run (destroy_distributed{why}) after {have} calls on {key}, "
        f"but rank {rank} issued call #{seq} ({op}) there and waits in {_where(mine)}"
    )


def _cycle_text(cycle: list[int], recs: dict[int, dict[str, Any]]) -> str:
    parts = []
    for rank in cycle:
        waits = _waits_on(rank, recs)
        peer, key, seq, op = waits[0]
        parts.append(
            f"rank {rank} waits in call #{seq} ({op}) on {key} ({_where(recs[rank])}), which "
            f"rank {peer} has not issued"
        )
    return "deadlock: " + "; ".join(parts)


def enable(on: bool) -> None:
    """Turn counting on or off (the watchdog's settings decide)."""
    global _on
    _on = on
