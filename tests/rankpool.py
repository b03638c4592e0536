"""Rank worker processes shared by the whole test run.

A multi-rank test needs ``world`` processes, each with ``import torch``, ``import ds_core`` and
an initialised process group: seconds of start-up per process on 2 cores, paid again by every
suite that spawned its own ranks. A :class:`RankPool` keeps ``world`` ranks alive for the run
(one pool per world size, backend and environment) and runs jobs on them:
``pool.run("tests.zero._worker:run_jobs", "stages", outdir)`` imports that function on every
rank, calls it with the arguments and returns each rank's result, in rank order. Its ranks
are forked from the test process's server that imported torch, torch._dynamo and ds_core
(tests/forkrank.py): a new pool (another environment, or one evicted or taken down) costs
its process group's start, not each rank's imports again. A pool whose environment sets
what acts only at a process's start (glibc's ``MALLOC_*``, :func:`tests.forkrank.not_applied`)
gets fresh interpreters instead.

Jobs share their ranks' process state, so a job must leave nothing behind that changes the
next one (the suites' jobs already run back to back in one process group). A job that raises
or times out on any rank takes its pool down, since the other ranks may be stuck in a
collective; the next job on that key starts a fresh pool.

Rank side: ``python -m tests.rankpool PORT KEY_FILE``, forked by the pool from the test
process's rank server (tests/forkrank.py).
"""

from __future__ import annotations

import importlib
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

from tests import forkrank

ROOT = Path(__file__).resolve().parents[1]
# A job is the work of one suite; the slowest (stage-3 NVMe parameter swap on sim) take
# minutes on 2 loaded cores.
JOB_TIMEOUT_S = 1200.0
START_TIMEOUT_S = 300.0
#: rank processes kept alive per test process (``DS_TEST_MAX_RANKS``; see :class:`RankPools`)
MAX_LIVE_RANKS = int(os.environ.get("DS_TEST_MAX_RANKS", "10"))


#: Ports handed out by :func:`free_port`: below Linux's default ephemeral range (32768-60999,
#: /proc/sys/net/ipv4/ip_local_port_range), from which every outgoing connection takes its
#: local port.
PORTS = range(20000, 32768)


def free_port() -> int:
    """A port nothing listens on now, for a rendezvous a rank binds later.

    Not one from the kernel (binding port 0): that comes from the ephemeral range, where any
    outgoing connection of any process (a gloo group's, a rank pool's) may take it before the
    rank binds it, and a full run saw EADDRINUSE that way. Drawn with the system's random source,
    not ``random`` (pytest-randomly seeds that alike in every xdist worker).
    """
    draw = secrets.SystemRandom()
    for _ in range(200):
        port = draw.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of a ``world``-rank run on this host, with its
    rendezvous at ``127.0.0.1:port``, and ``extra`` on top (``DS_ACCELERATOR``, ...)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **extra,
    }


def run_script_ranks(code: str, argv: list[str], world: int, timeout: float, **env: str) -> str:
    """Run ``python -c code *argv`` as each rank of a ``world``-rank run on this host (``env``
    on top); return rank 0's output (stdout and stderr) once it exits within ``timeout``
    seconds (a hang guard), the others then waited for 60 s and any rank still running killed.

    The ranks are forked from a server that imported torch and ds_core (tests/forkrank.py): a
    case's time goes to the code under test, not to each interpreter's start-up. ``code``
    must flush what it prints before an ``os._exit``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="script-ranks-") as folder:
        logs = [Path(folder) / f"rank{rank}.log" for rank in range(world)]
        procs = [
            forkrank.popen(
                ["-c", code, *argv],
                {**os.environ, **rank_env(rank, world, port, OMP_NUM_THREADS="1", **env)},
                out=logs[rank],
                err=logs[rank],
            )
            for rank in range(world)
        ]
        try:
            out, _ = procs[0].communicate(timeout=timeout)
            for p in procs[1:]:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return out


class RankPool:
    """``world`` rank processes with a gloo (or the backend's) process group, serving jobs.

    :param world: number of ranks.
    :param env: the ranks' environment on top of this process's (backend selection,
        ``DS_SIM_*``, ...); ``RANK``, ``WORLD_SIZE``, ``MASTER_*`` are set by the pool.
    """

    def __init__(self, world: int, env: dict[str, str]) -> None:
        self.world = world
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._logdir = Path(tempfile.mkdtemp(prefix="rankpool-"))
        port = free_port()
        # The key travels in a file only this user can read, not in the visible command line.
        key = self._logdir / "key"
        key.touch(mode=0o600)
        key.write_bytes(self._authkey)
        self._procs: list[forkrank.Forked | subprocess.Popen[bytes]] = []
        for rank in range(world):
            # PYTHONFAULTHANDLER: a rank killed by a signal (a crash in a backend's native
            # code) leaves its threads' Python stacks in its log, which the failure shows.
            env_r = {
                **env,
                **rank_env(
                    rank,
                    world,
                    port,
                    OMP_NUM_THREADS="1",
                    PYTHONUNBUFFERED="1",
                    PYTHONFAULTHANDLER="1",
                ),
            }
            log = self._logdir / f"rank{rank}.log"
            argv = ["-m", "tests.rankpool", str(self._listener.address[1]), str(key)]
            if forkrank.not_applied(env_r):  # e.g. glibc's MALLOC_*: read at process start
                with open(log, "wb") as out:
                    fresh = [sys.executable, *argv]
                    self._procs.append(
                        subprocess.Popen(fresh, cwd=ROOT, env=env_r, stdout=out, stderr=out)
                    )
            else:
                # forked from a server that imported torch, torch._dynamo and ds_core
                # (tests/forkrank.py): a pool's start is its process group's, not seconds of
                # imports per rank
                self._procs.append(forkrank.popen(argv, env_r, out=log, err=log))
        self._conns: list[Connection] = [None] * world  # type: ignore[list-item]
        try:
            self._accept()
        finally:
            key.unlink()  # read by every rank that connected

    def _accept(self) -> None:
        # Listener.accept() has no timeout: wait for the socket to be readable first, so a
        # rank that dies during start-up is reported instead of hanging the test run.
        sock = self._listener._listener._socket  # type: ignore[attr-defined]
        try:
            for _ in range(self.world):
                if not wait([sock], START_TIMEOUT_S):
                    raise OSError(f"a rank did not connect in {START_TIMEOUT_S:.0f} s")
                conn = self._listener.accept()
                self._conns[conn.recv()] = conn
        except (OSError, EOFError) as exc:
            self.close(graceful=False)
            message = f"rank pool of {self.world} did not start: {exc}\n{self.logs()}"
            raise AssertionError(message) from exc
        self._recv_all("start", START_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def run(self, target: str, *args: Any, timeout: float = JOB_TIMEOUT_S) -> list[Any]:
        """Call ``module:function`` with ``args`` on every rank; its results in rank order.

        :raises AssertionError: a rank raised (its traceback), exited, or did not finish in
            ``timeout`` seconds; the pool is closed then.
        """
        for conn in self._conns:
            conn.send((target, args))
        return self._recv_all(target, timeout)

    def _recv_all(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(pending.values())
                self._fail(f"{what}: ranks {late} did not finish in {timeout:.0f} s")
            for conn in ready:
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    status, value = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._fail(f"{what}: rank {rank} exited (code {self._procs[rank].poll()})")
                if status != "ok":
                    self._fail(f"{what}: rank {rank} raised:\n{value}")
                results[rank] = value
        return [results[r] for r in range(self.world)]

    def _fail(self, message: str) -> None:
        self.close(graceful=False)
        raise AssertionError(f"{message}\n{self.logs()}")

    def logs(self, tail: int = 4000) -> str:
        parts = []
        for rank in range(self.world):
            path = self._logdir / f"rank{rank}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- rank {rank} output (last {tail} characters):\n{text[-tail:]}")
        return "\n".join(parts)

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: a clean teardown of their process group when ``graceful``, else
        killed (after a failure, when they may be stuck in a collective)."""
        if graceful:
            self.request_stop()
        self.reap(timeout=60 if graceful else 0)

    def request_stop(self) -> None:
        """Ask the ranks to tear their process group down and exit, without waiting: closing
        several pools then overlaps their exits (:meth:`reap` waits)."""
        if self.alive:
            try:
                for conn in self._conns:
                    conn.send(None)
            except OSError:
                pass

    def reap(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the ranks to exit, kill any left, and
        close the connections."""
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._listener.close()


class RankPools:
    """The test process's pools, one per (world, environment): created on first use, reused by
    later tests, closed at the end. At most :data:`MAX_LIVE_RANKS` rank processes stay alive:
    the least recently used pools are closed to make room (each rank holds a few hundred MiB,
    and the suite runs in two test processes: keeping every pool of the run alive exhausted
    the 24 GiB host, whose OOM killer then took a later test's ranks)."""

    def __init__(self) -> None:
        #: least recently used first
        self._pools: dict[tuple[int, tuple[tuple[str, str], ...]], RankPool] = {}
        #: evicted pools whose ranks were asked to exit and are not yet reaped
        self._stopping: list[RankPool] = []

    def get(self, world: int, env: dict[str, str]) -> RankPool:
        """A live pool of ``world`` ranks whose environment is this process's (less its
        ``DS_SIM_*`` settings) with ``env`` applied."""
        key = (world, tuple(sorted(env.items())))
        pool = self._pools.pop(key, None)
        if pool is None or not pool.alive:
            self._make_room(world)
            base = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
            pool = RankPool(world, {**base, **env})
        self._pools[key] = pool  # now the most recently used
        return pool

    def _make_room(self, world: int) -> None:
        # An evicted pool's ranks exit while the new pool starts: the test waits for neither
        # the other's teardown nor its interpreter's finalization.
        while self._pools and sum(p.world for p in self._pools.values()) + world > MAX_LIVE_RANKS:
            oldest = self._pools.pop(next(iter(self._pools)))
            oldest.request_stop()
            self._stopping.append(oldest)
        still = []
        for pool in self._stopping:
            if pool.alive:
                still.append(pool)
            else:
                pool.reap(timeout=0)
        self._stopping = still

    def close(self) -> None:
        pools = [*self._stopping, *self._pools.values()]
        for pool in pools:
            pool.request_stop()
        for pool in pools:
            pool.reap(timeout=60)
        self._pools.clear()
        self._stopping.clear()


# --------------------------------------------------------------------------- rank side


def _call(target: str, args: tuple[Any, ...]) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def serve(port: int, key: str) -> None:
    authkey = Path(key).read_bytes()
    rank = int(os.environ["RANK"])
    conn = Client(("127.0.0.1", port), authkey=authkey)
    conn.send(rank)
    try:
        import torch

        torch.set_num_threads(1)
        import ds_core

        ds_core.init_distributed(timeout=300)
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        message = conn.recv()
        if message is None:
            break
        try:
            reply = ("ok", _call(*message))
        except BaseException:
            reply = ("error", traceback.format_exc())
        # Plain pickle, not the connection's: torch registers multiprocessing reductions that
        # would pass tensors as shared-memory file descriptors.
        conn.send_bytes(pickle.dumps(reply))
    # gloo's threads must not outlive the interpreter
    torch.distributed.barrier()
    ds_core.destroy_distributed()
    # Skip the interpreter's finalization (about a second of CPU per rank after importing
    # torch, on this suite's 2 cores): the group is down and the log is line-buffered, so
    # nothing is left to flush or release.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
