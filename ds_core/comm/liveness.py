"""The liveness watchdog: a rank that dies is named within seconds (docs/architecture.md §3.10).

A daemon thread per rank, started by :func:`ds_core.init_distributed` when the world has more
than one rank, works over its own connection to the rendezvous store (the TCP store that
``env://`` or ``tcp://`` initialisation, and torchrun's agents, already serve), so it works
on every backend and never queues behind a store request of the training thread. Once a
period it

- bumps its own heartbeat counter (``hb/<rank>``);
- reads the counter of the next rank in a ring (``rank + 1`` modulo the world) and the shared
  verdict key: a ring keeps the store's load at two requests per rank and period, and a
  verdict published by the first rank that notices reaches every other rank on its next tick.

A peer whose counter has not moved for ``misses`` periods (counted on this rank's own
monotonic clock, so hosts' clocks need not agree, and in this thread's own ticks, so a host too
loaded to run this thread does not blame the peer; :data:`STARTUP_FACTOR` times as long for a
peer whose first heartbeat has not come yet), or a store that has not answered for as
long (the host serving it died: rank 0's node, or torchrun's rendezvous host), ends this
process: one line on stderr naming the dead rank, its host and what this rank was doing, the
cleanups registered with :func:`on_abort` (they would not run under ``os._exit``), then
``os._exit(EXIT_CODE)``. What this rank was doing is read from its main thread's Python stack
at that moment (:data:`PHASES`), so a step pays nothing for it: no marker is written per call.

A rank leaving cleanly (:func:`stop`, from ``destroy_distributed``) publishes ``left/<rank>``;
from then on the others stand down, since the run is ending and its store host may go first
(but still report a call of theirs the leaver never issued: :mod:`ds_core.hangs`).

The same thread drives the hang check (:mod:`ds_core.hangs`, ``DS_HANG_CHECK``): live ranks
whose calls disagree end with exit status 70 (:data:`ds_core.hangs.EXIT_CODE`) and one line.

Settings (environment, read at start): ``DS_LIVENESS`` (``0`` turns it off),
``DS_LIVENESS_PERIOD_S`` (heartbeat period, seconds, default 1) and ``DS_LIVENESS_MISSES``
(periods without a heartbeat before a peer is declared dead, default 10). DeepSpeed 0.19.8
has no equivalent to name these after (its sources hold no heartbeat or watchdog of ranks).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from ds_core import hangs
from ds_core.accelerator import get_accelerator
from ds_core.errors import ConfigError

#: exit status of a rank ended by the watchdog (EX_TEMPFAIL: a peer failed, not this rank).
EXIT_CODE = 75
_PREFIX = "ds_core/liveness/"
#: a watched peer that has not sent its first heartbeat gets this many bounds: it may still be
#: between the process group's rendezvous and its watchdog's start on a loaded host.
STARTUP_FACTOR = 3

#: (module, function) -> what a rank is doing while that function is on its main thread's
#: stack; the innermost match is named first. tests/test_liveness.py checks each one exists.
PHASES: dict[tuple[str, str], str] = {
    **{("ds_core.facade", name): name for name in sorted(hangs.COMM_FUNCS)},
    ("ds_core.zero.engine", "forward"): "forward",
    ("ds_core.zero.engine", "backward"): "backward",
    ("ds_core.zero.engine", "step"): "optimizer step",
    ("ds_core.checkpoint._save", "save_checkpoint"): "checkpoint save",
    ("ds_core.checkpoint._load", "load_checkpoint"): "checkpoint load",
    ("ds_core.zero.offload.nvme", "_write"): "NVMe swap-out",
    ("ds_core.zero.offload.nvme", "_read"): "NVMe swap-in",
    ("ds_core.zero.offload.nvme_param", "_write"): "NVMe swap-out",
    ("ds_core.zero.offload.nvme_param", "fetch"): "NVMe swap-in",
}
_TORCH_C10D = hangs._TORCH_C10D


@dataclass(frozen=True, slots=True)
class Settings:
    """The watchdog's settings.

    :param enabled: whether :func:`start` starts a watchdog (on multi-rank worlds only).
    :param period_s: seconds between heartbeats (and checks).
    :param misses: periods without a peer's heartbeat (or a store answer) before it is dead.
    """

    enabled: bool = True
    period_s: float = 1.0
    misses: int = 10

    @classmethod
    def from_env(cls) -> Settings:
        """Read ``DS_LIVENESS``, ``DS_LIVENESS_PERIOD_S`` and ``DS_LIVENESS_MISSES``.

        :raises ConfigError: a value that is not a number in range, naming it and the fix.
        """
        flag = os.environ.get("DS_LIVENESS", "1").strip().lower()
        if flag not in ("0", "1", "true", "false", "on", "off"):
            raise ConfigError(f"DS_LIVENESS={flag!r}: expected 1/0 (on/off, true/false)")
        period = _number("DS_LIVENESS_PERIOD_S", "1.0", float, 0.05)
        misses = _number("DS_LIVENESS_MISSES", "10", int, 2)
        return cls(flag in ("1", "true", "on"), float(period), int(misses))


def _number(name: str, default: str, kind: type[int] | type[float], low: float) -> float:
    text = os.environ.get(name, default)
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ConfigError(f"{name}={text!r}: expected a {kind.__name__} >= {low}")
    return value


_abort_lock = threading.Lock()
_abort_callbacks: dict[str, Callable[[], None]] = {}


def on_abort(key: str, callback: Callable[[], None] | None) -> None:
    """Register (or, with ``None``, drop) a cleanup run when the watchdog ends this process.

    ``os._exit`` skips ``atexit`` and ``finally``; what ds_core owns that would outlive the
    process (a swap folder, a shared-memory name) registers its removal here under a unique
    ``key``, and drops it once removed normally. Callbacks must not block on a peer.
    """
    with _abort_lock:
        if callback is None:
            _abort_callbacks.pop(key, None)
        else:
            _abort_callbacks[key] = callback


def _stack(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _traceback_frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]


def phase_of(frames: Iterable[FrameType]) -> str:
    """What a stack (``frames``, innermost first) is doing: "all_gather within optimizer
    step"; the innermost frame's function and place when no phase of :data:`PHASES` matches."""
    found: list[str] = []
    top: FrameType | None = None
    for frame in frames:
        top = top or frame
        code = frame.f_code
        module = frame.f_globals.get("__name__", "")
        label = PHASES.get((module, code.co_name))
        if label is None and module == _TORCH_C10D and not code.co_name.startswith("_"):
            label = f"torch.distributed.{code.co_name}"
        if label is not None and (not found or found[-1] != label):
            found.append(label)
    if found:
        return " within ".join(found)
    if top is None:
        return "no Python code (the main thread has ended)"
    return f"{top.f_code.co_name} ({os.path.basename(top.f_code.co_filename)}:{top.f_lineno})"


def main_thread_phase() -> str:
    """:func:`phase_of` the main thread's current stack."""
    return phase_of(_stack(sys._current_frames().get(threading.main_thread().ident or -1)))


def _store_address(init_method: str | None) -> tuple[str, int] | None:
    if init_method is None or init_method.startswith("env://"):
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        return (addr, int(port)) if addr and port else None
    if init_method.startswith("tcp://"):
        url = urlparse(init_method)
        return (url.hostname, url.port) if url.hostname and url.port else None
    return None


class Watchdog:
    """One rank's heartbeat and watch (see the module docstring); :func:`start` builds it."""

    def __init__(self, store: Any, rank: int, world: int, settings: Settings, where: str):
        self.store, self.rank, self.world, self.settings = store, rank, world, settings
        self.where = where  # the store's address, for the message when it stops answering
        self.peer = (rank + 1) % world
        self.failed = False  # the main thread ended on an uncaught exception
        self.stood_down = False  # a rank left cleanly: the run is ending, no verdicts
        self.phase: str | None = None  # what the main thread was doing, once it has ended
        self.hosts_store = False  # the store lives in this process (set by start())
        self._stop = threading.Event()
        gen = (int(store.add(_PREFIX + "inits", 1)) - 1) // world
        self.ns = f"{_PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{gen}/"
        store.set(self.ns + f"host/{rank}", socket.gethostname())
        self.beats = 0
        self._beat()
        self.hosts: dict[int, str] = {}
        try:  # rank 0's host names the store's when it is gone: known from the start
            store.wait(
                [self.ns + "host/0"],
                datetime.timedelta(seconds=settings.misses * settings.period_s),
            )
            self._host(0)
        except Exception:
            pass  # rank 0 has not published it in the bound: "unknown", as before
        self.answered_at = time.monotonic()
        hang = hangs.Settings.from_env(settings.misses * settings.period_s)
        hangs.enable(hang.enabled)
        #: the hang check (ds_core/hangs.py), riding on this thread and connection.
        self.hang = (
            hangs.Checker(self, hang, not get_accelerator().is_synchronized_device())
            if hang.enabled
            else None
        )
        self.thread = threading.Thread(target=self._run, name="ds_core-liveness", daemon=True)

    def main_phase(self) -> str:
        """What the main thread is doing (:func:`main_thread_phase`), for the hang check."""
        return main_thread_phase()

    def _beat(self) -> None:
        self.beats += 1
        self.store.set(self.ns + f"hb/{self.rank}", str(self.beats))

    def _host(self, rank: int) -> str:
        if rank not in self.hosts:
            try:
                if not self.store.check([self.ns + f"host/{rank}"]):
                    return "unknown"
                self.hosts[rank] = bytes(self.store.get(self.ns + f"host/{rank}")).decode()
            except Exception:  # the store is gone: the host is unknown, not an error of ours
                return "unknown"
        return self.hosts[rank]

    def _store_gone(self, now: float) -> dict[str, Any]:
        where = f"{self._host(0)}, whose rendezvous store at {self.where} stopped answering"
        return {"rank": 0, "host": where, "ago": now - self.answered_at}

    def _raised(self, rank: int) -> bool:
        try:
            return bool(self.store.check([self.ns + f"failed/{rank}"]))
        except Exception:
            return False

    def _failure(self, rank: int) -> tuple[int, str] | None:
        """(order among the ranks that raised, ``Type: message``) of a rank that raised."""
        try:
            key = self.ns + f"failed/{rank}"
            if not self.store.check([key]):
                return None
            order, _, summary = bytes(self.store.get(key)).decode().partition("|")
            return int(order), summary
        except Exception:
            return None

    def _why(self, rank: int) -> str:
        """`` (Type: message)`` of a rank that raised, when it published one."""
        found = self._failure(rank)
        return f" ({found[1]})" if found is not None and found[1] else ""

    def mark_failed(self, summary: str = "1") -> None:
        """Publish that this rank's main thread ended on an uncaught exception (``summary``:
        its type and first line): peers diagnosing their own errors do not take it for a dead
        rank (it raised too), and one waiting in a collective names it."""
        self.failed = True
        try:
            order = int(self.store.add(self.ns + "fails", 1))
            self.store.set(self.ns + f"failed/{self.rank}", f"{order}|{summary}")
            if self.hang is not None:  # its last calls, for the peers' mismatch check
                record = self.hang.record(time.monotonic())
                self.store.set(self.ns + f"prog/{self.rank}", json.dumps(record))
        except Exception:
            pass  # the store is gone: diagnose() reports that

    def explain(self, frames: list[FrameType]) -> dict[str, Any] | None:
        """After :meth:`diagnose` found every peer alive, for a rank whose main thread raised
        (:attr:`phase` set): a mismatch of the ranks' calls (the transport may raise on one),
        or a peer that raised before this rank with another error, or while this rank was in
        communication (this error is the consequence). ``None``: this rank's own error
        stands (every rank raising the same error prints its traceback)."""
        try:
            if self.hang is not None:
                text = self.hang.mismatch_now()
                if text is not None:
                    return {"hang": text}
            in_comm = hangs.raised_in_comm(self.phase or "", frames)
            mine = self._failure(self.rank) or (1 << 62, "")
            for rank in range(self.world):
                found = self._failure(rank) if rank != self.rank else None
                if found is None:
                    continue
                if in_comm or (found[0] < mine[0] and found[1] != mine[1]):
                    text = f"rank {rank} (host {self._host(rank)}) raised first ({found[1]})"
                    return {"hang": text, "code": EXIT_CODE}
        except Exception:
            return None  # the store is gone: the traceback stands
        return None

    def _verdict(self) -> dict[str, Any] | None:
        key = self.ns + "verdict"
        if not self.store.check([key]):
            return None
        found: dict[str, Any] = json.loads(bytes(self.store.get(key)))
        return found

    def _run(self) -> None:
        period, misses = self.settings.period_s, self.settings.misses
        peer_hb, left = self.ns + f"hb/{self.peer}", self.ns + "left"
        last_seen: bytes | None = None
        seen_at = time.monotonic()
        silent = 0  # this thread's own ticks since the peer's heartbeat last moved
        while not self._stop.wait(period):
            now = time.monotonic()
            try:
                self._beat()
                if 0 not in self.hosts or self.peer not in self.hosts:
                    # cached while the store answers (a rank may publish its host after
                    # this thread starts): named when the store is gone, or the peer
                    self._host(0), self._host(self.peer)
                if self.store.check([left]):
                    if self.hang is not None:
                        self.hang.read_leavers()
                    self.stood_down = True
                    self.store.add(self.ns + "down", 1)  # tells the leaving store host
                    # a rank left cleanly: the run is ending, stand down (from the store)
                    return self._watch_leavers()
                found = self._verdict()
                if found is not None:
                    self._abort(found)
                value = bytes(self.store.get(peer_hb)) if self.store.check([peer_hb]) else b""
                self.answered_at = now
                if self.hang is not None:
                    self.hang.tick(now)  # may end the process on a hang verdict
            except Exception:
                # A client whose connection broke does not reconnect: wait out the bound
                # without more requests (each failure logs a trace), unless told to stop.
                if not self._stop.wait(max(0.0, self.answered_at + misses * period - now)):
                    self._abort(self._store_gone(time.monotonic()))
                return
            if value != last_seen:
                last_seen, seen_at, silent = value, now, 0
                continue
            silent += 1
            # The bound is counted in this thread's own ticks as well as in seconds: on a host
            # so loaded that this thread itself did not run, the seconds it missed are not
            # evidence against the peer. A peer with no heartbeat yet is still starting (its
            # first beat comes with its watchdog, after the process group is up), so it gets
            # STARTUP_FACTOR bounds before it is called dead.
            bound = misses if value else misses * STARTUP_FACTOR
            if silent >= bound and now - seen_at >= bound * period:
                found = {"rank": self.peer, "host": self._host(self.peer), "ago": now - seen_at}
                if self._raised(self.peer):
                    found["how"] = (
                        f"ended on an uncaught exception{self._why(self.peer)} and stopped responding"
                    )
                try:
                    self.store.set(self.ns + "verdict", json.dumps(found))
                except Exception:
                    pass  # the others reach their own verdict from the store or the ring
                self._abort(found)

    def _watch_leavers(self) -> None:
        # No store requests (its host may be gone): a call of this rank that a rank which
        # left never issued can never complete, so it is reported from the leaver's record.
        while (
            self.hang is not None and self.hang.left and not self._stop.wait(self.settings.period_s)
        ):
            text = self.hang.ahead_of_leavers()
            if text is not None:
                self._abort({"hang": text})

    def diagnose(self) -> dict[str, Any] | None:
        """Whether a peer is dead, read from every rank's heartbeat over up to ``misses``
        periods (this rank keeps beating meanwhile). For a rank whose main thread raised: the
        error may be its transport noticing a dead peer. ``None``: every peer is beating.
        """
        period, misses = self.settings.period_s, self.settings.misses
        others = [r for r in range(self.world) if r != self.rank]
        keys = [self.ns + f"hb/{r}" for r in others]
        start = time.monotonic()
        try:
            found = self._verdict() or self._left_verdict()
            first = self.store.multi_get(keys) if found is None else []
        except Exception:
            return self._store_gone(time.monotonic())
        if found is not None:
            return found or None
        stale = dict(zip(others, first, strict=True))
        while True:
            time.sleep(period)
            now = time.monotonic()
            try:
                self._beat()
                found = self._verdict() or self._left_verdict()
                if found is not None:
                    return found or None
                values = dict(zip(others, self.store.multi_get(keys), strict=True))
                self.answered_at = now
            except Exception:
                if now - self.answered_at >= misses * period:
                    return self._store_gone(now)
                continue
            stale = {r: v for r, v in stale.items() if values[r] == v and not self._raised(r)}
            if not stale:
                return None
            if now - start >= misses * period:
                dead = min(stale)
                return {"rank": dead, "host": self._host(dead), "ago": now - start}

    def _left_verdict(self) -> dict[str, Any] | None:
        """After a peer left cleanly (its transport may show this rank its exit before this
        thread reads ``left``): the hang check's report of a call the leaver never issued,
        ``{}`` when there is none (the run is ending), ``None`` when no rank left."""
        if not self.store.check([self.ns + "left"]):
            return None
        self.stood_down = True
        if self.hang is None:
            return {}
        self.hang.read_leavers()
        text = self.hang.ahead_of_leavers()
        return {} if text is None else {"hang": text}

    def _abort(self, found: dict[str, Any]) -> None:
        with _exit_lock:  # held until os._exit: one line, one exit, from one thread
            phase = self.phase or main_thread_phase()
            how = found.get("how", "stopped responding")
            if "hang" in found:
                message = (
                    f"ds_core: {found['hang']}; this rank is {self.rank} (in {phase}); exiting"
                )
                code = found.get("code", hangs.EXIT_CODE)
            else:
                message, code = (
                    (
                        f"ds_core: rank {found['rank']} (host {found['host']}) {how} "
                        f"{found['ago']:.1f} s ago while this rank ({self.rank}) was in {phase}; "
                        "exiting"
                    ),
                    EXIT_CODE,
                )
            try:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
            except Exception:
                os.write(2, (message + "\n").encode())
            with _abort_lock:
                callbacks = list(_abort_callbacks.values())
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    pass  # best effort: the process is ending on a peer's failure already
            self._let_others_read(found)
            os._exit(code)

    def _let_others_read(self, found: dict[str, Any]) -> None:
        """Publish the verdict (a rank that diagnosed its own error has not) and count this
        rank out. The process serving the store (rank 0 under env:// or tcp://) then waits,
        up to the watchdog's bound, until every other rank but the dead one has counted
        out: gone first, it would take the store with it, and ranks yet to read the verdict
        would name rank 0, the store's host, instead of the dead rank."""
        try:
            if "rank" in found:
                self.store.compare_set(self.ns + "verdict", "", json.dumps(found))
            out = int(self.store.add(self.ns + "aborted", 1))
            # at a hang verdict (ds_core/hangs.py) no rank is dead: every one must read it
            ranks = self.world if "hang" in found and "code" not in found else self.world - 1
            deadline = time.monotonic() + self.settings.misses * self.settings.period_s
            while self.hosts_store and out < ranks and time.monotonic() < deadline:
                time.sleep(self.settings.period_s / 4)
                out = int(self.store.add(self.ns + "aborted", 0))
        except Exception:
            pass  # the store is gone: nobody can read a verdict any more

    def stop(self, clean: bool) -> None:
        """End the thread; ``clean`` publishes that this rank left on purpose."""
        self._stop.set()
        if clean:
            self.stood_down = True
            try:
                if self.hang is not None:  # what it issued: peers ahead of it are stuck
                    record = self.hang.record(time.monotonic(), left=True)
                    self.store.set(self.ns + f"prog/{self.rank}", json.dumps(record))
                self.store.set(self.ns + "left", str(self.rank))
                down = int(self.store.add(self.ns + "down", 1))
                # Rank 0's process (or node) serves the store: before it goes, let every
                # other watchdog read "left" (about one period), or they would take the
                # store's end for a dead node. Bounded: a rank may be dead already.
                deadline = time.monotonic() + self.settings.misses * self.settings.period_s
                while self.rank == 0 and down < self.world and time.monotonic() < deadline:
                    time.sleep(self.settings.period_s / 4)
                    down = int(self.store.add(self.ns + "down", 0))
            except Exception:
                pass  # the store's host left first: the others stand down on their own
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=self.settings.misses * self.settings.period_s + 5)


_exit_lock = threading.Lock()
_current: Watchdog | None = None
#: the last watchdog started, kept after :func:`stop` for the exception hook's diagnosis.
_last: Watchdog | None = None
_previous_hook: Callable[..., Any] | None = None


def start(init_method: str | None = None) -> Watchdog | None:
    """Start this rank's watchdog after ``torch.distributed`` is initialised.

    Also installs a ``sys.excepthook`` that, when the main thread ends on an uncaught
    exception, first checks whether a peer is dead (:meth:`Watchdog.diagnose`: up to
    ``misses`` periods) and if so ends the process with the watchdog's line instead of the
    transport's traceback.

    :returns: the watchdog, or ``None`` when off (``DS_LIVENESS=0``, one rank, no process
        group, or already running).
    :raises ConfigError: a bad ``DS_LIVENESS*`` variable, or liveness on with an init method
        that has no TCP store (``file://``...): set ``DS_LIVENESS=0`` or use ``env://``.
    """
    global _current, _last, _previous_hook
    settings = Settings.from_env()
    if not settings.enabled or _current is not None or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    if world < 2:
        return None
    address = _store_address(init_method)
    if address is None:
        raise ConfigError(
            f"the liveness watchdog needs a TCP rendezvous store; init_method={init_method!r} "
            "has none: use env:// or tcp://, or set DS_LIVENESS=0 to rely on the process "
            "group's timeout alone"
        )
    store = dist.TCPStore(  # type: ignore[attr-defined]  # own connection: not queued behind the trainer
        address[0],
        address[1],
        is_master=False,
        timeout=datetime.timedelta(seconds=settings.misses * settings.period_s),
    )
    _current = _last = Watchdog(
        store, dist.get_rank(), world, settings, f"{address[0]}:{address[1]}"
    )
    # env:// and tcp:// start the store in rank 0's process; torchrun's agent serves its own
    _current.hosts_store = _current.rank == 0 and (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    )
    _current.thread.start()
    if _previous_hook is None:
        _previous_hook, sys.excepthook = sys.excepthook, _excepthook
    return _current


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    watchdog = _last
    if watchdog is not None and watchdog.stood_down and watchdog.hang is not None:
        text = watchdog.hang.ahead_of_leavers()  # the transport saw the leaver go first
        if text is not None:
            watchdog.phase = phase_of(_traceback_frames(tb))
            watchdog._abort({"hang": text})
    if watchdog is not None and not watchdog.stood_down and issubclass(kind, Exception):
        watchdog.phase = phase_of(_traceback_frames(tb))
        watchdog.mark_failed(f"{kind.__name__}: {value}".splitlines()[0][:200])
        found = watchdog.diagnose() or watchdog.explain(_traceback_frames(tb))
        if found is not None:
            watchdog._abort(found)
        watchdog.phase = None
    (_previous_hook or sys.__excepthook__)(kind, value, tb)


def stop(clean: bool = True) -> None:
    """Stop this rank's watchdog (``destroy_distributed`` calls it first). Safe to repeat.

    :param clean: publish that this rank leaves on purpose (ignored after an uncaught
        exception: the others then see a rank that stopped responding).
    """
    global _current
    watchdog, _current = _current, None
    if watchdog is not None:
        watchdog.stop(clean and not watchdog.failed)


def _forget_in_child() -> None:
    # A forked child (a data-loader worker) has no watchdog thread and must not publish
    # that its parent's rank left, nor diagnose its parent's peers.
    global _current, _last
    _current = _last = None


os.register_at_fork(after_in_child=_forget_in_child)
