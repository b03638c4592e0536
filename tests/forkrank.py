"""Rank processes forked from a server that imported torch and ds_core once.

A fault test's ranks are fresh interpreters (``python -m tests._hangs_rank ...``): on the
suite's 2 cores each spends seconds importing torch, and as much again on ``torch._dynamo``,
which ``torch.optim.Optimizer.__init__`` imports on first use (torch/_compile.py), before it
reaches the code under test. :func:`popen` starts the same command line as a child forked from
one server per test process that has imported :data:`PRELOAD`; the child sets its environment,
working directory and output files, then runs the module or code as ``python -m`` / ``-c``
would, and exits through the interpreter's normal exit (``atexit`` handlers run). What a
fresh interpreter takes from its environment at start, the child applies from the one it is
given: ``PYTHONFAULTHANDLER`` (the stacks of a crash) and ``PYTHONUNBUFFERED`` (stdout
line-buffered). The rank pools' ranks (tests/rankpool.py) are forked here too.

What a forked rank shares with a fresh one: everything but the preloaded modules' import-time
state. They must not select a backend nor read ``DS_*`` variables at import, and the server
must start no thread before it forks (a fork copies only the forking thread): both hold for
the modules below, and the server checks the second. What it does not cover: an
interpreter's own start-up, which the torchrun tests (tests/test_example.py, ...) run.

Server side: ``python -m tests.forkrank`` (started by :class:`Forker`); one JSON request per
line on stdin, one JSON reply per line on stdout: ``{"pid": P, "tag": T}`` once forked, then
``{"exit": P, "code": C}`` when it ends.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "ds_core", "ds_core.zero")


# --------------------------------------------------------------------------- server side


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python ARGV...``; leaves through SystemExit."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], write)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    if request["err"] == request["out"]:
        os.dup2(1, 2)  # one open file and offset, interleaved as stderr=subprocess.STDOUT
    else:
        opened = os.open(request["err"], write, 0o644)
        os.dup2(opened, 2)
        os.close(opened)
    # what these variables do at a fresh interpreter's start
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    flag, target, *args = request["argv"]
    if flag == "-m":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    sys.exit(0)


def serve() -> None:
    for name in PRELOAD:
        __import__(name)
    if threading.active_count() != 1:
        raise SystemExit(f"forkrank: threads before forking: {threading.enumerate()}")
    replies = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a child's stray print is not a reply

    def reply(message: dict[str, Any]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    reply({"ready": True})
    live: set[int] = set()
    pending = b""
    open_input = True
    while open_input or live:
        ready, _, _ = select.select([0] if open_input else [], [], [], 0.02)
        if ready:
            chunk = os.read(0, 1 << 16)
            open_input = bool(chunk)
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(replies)
                _child(request)
            live.add(pid)
            reply({"pid": pid, "tag": request["tag"]})
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                live.discard(pid)
                reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# --------------------------------------------------------------------------- client side

#: what a forked child applies itself (:func:`_child`), or needs not (the server's sys.path)
_APPLIED = frozenset({"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONPATH"})


def _acts_at_start(name: str) -> bool:
    """Read once when a process or interpreter starts: glibc's malloc and tunables, the
    dynamic loader's, Python's own."""
    return name.startswith(("MALLOC_", "LD_", "PYTHON")) or name == "GLIBC_TUNABLES"


def not_applied(env: dict[str, str]) -> list[str]:
    """The variables of ``env`` a forked child would not get: those read at a process's start
    whose value differs from the server's (e.g. ``MALLOC_MMAP_THRESHOLD_``). Where there are
    any, the process must be a fresh one."""
    server = _forker.env if _forker is not None else os.environ
    names = {k for k in (*env, *server) if _acts_at_start(k) and k not in _APPLIED}
    return sorted(k for k in names if env.get(k) != server.get(k))


class Forker:
    """The test process's server: :meth:`start` a rank, its exit reported to its
    :class:`Forked`."""

    def __init__(self) -> None:
        #: the server's environment, and so what its children start with
        self.env = dict(os.environ)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkrank"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        if not self.proc.stdout.readline():
            raise RuntimeError(f"the rank fork server did not start (exit {self.proc.wait()})")
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}  # tag -> pid
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._tag = 0
        #: the ranks' output files when a test names none, removed by :meth:`close`
        self._folder = Path(tempfile.mkdtemp(prefix="forkrank-"))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout as replies:  # closed at the server's exit
            for line in replies:
                message = json.loads(line)
                with self._lock:
                    if "tag" in message:
                        self._pids[message["tag"]] = message["pid"]
                    else:
                        self._codes[message["exit"]] = message["code"]
                    self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def start(
        self, argv: list[str], env: dict[str, str], cwd: Path, out: Path | None, err: Path | None
    ) -> Forked:
        with self._lock:
            self._tag += 1
            tag = self._tag
        out, err = out or self._folder / f"{tag}.out", err or self._folder / f"{tag}.err"
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "out": str(out),
            "err": str(err),
            "tag": tag,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        with self._lock:
            if not self._lock.wait_for(
                lambda: tag in self._pids or self.proc.poll() is not None, 60
            ):
                raise RuntimeError("the rank fork server did not fork in 60 s")
            if tag not in self._pids:
                raise RuntimeError(f"the rank fork server exited ({self.proc.poll()})")
            pid = self._pids.pop(tag)
        return Forked(self, pid, out, err)

    def code(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._codes or self.proc.poll() is not None, timeout)
            return self._codes.get(pid)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


class Forked:
    """A forked rank, with the part of :class:`subprocess.Popen` the fault tests use; its
    stdout and stderr are files, read by :meth:`communicate` once it has exited."""

    def __init__(self, forker: Forker, pid: int, out: Path, err: Path) -> None:
        self._forker, self.pid, self._files = forker, pid, (out, err)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._forker.code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._forker.code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr once it has exited; stderr is ``""`` when it went to stdout's
        file (as ``stderr=subprocess.STDOUT``)."""
        self.wait(timeout)
        out, err = (path.read_text(errors="replace") for path in self._files)
        return out, "" if self._files[1] == self._files[0] else err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


_forker: Forker | None = None


def popen(
    argv: list[str],
    env: dict[str, str],
    cwd: Path = ROOT,
    out: Path | None = None,
    err: Path | None = None,
) -> Forked:
    """Start ``python ARGV`` (``-m MODULE ...`` or ``-c CODE ...``) as a rank forked from this
    test process's server (started on first use, ended at exit), in environment ``env`` (all
    of it) and folder ``cwd``; its stdout and stderr go to ``out`` and ``err`` (default: files
    of its own, read by :meth:`Forked.communicate`); ``err == out`` sends both to ``out``.

    :raises ValueError: ``env`` sets what a forked child cannot apply (:func:`not_applied`).
    """
    global _forker
    if _forker is None or _forker.proc.poll() is not None:
        import atexit

        _forker = Forker()
        atexit.register(_forker.close)
    missing = not_applied(env)
    if missing:
        raise ValueError(f"a forked rank cannot apply {missing}: start a fresh interpreter")
    return _forker.start(argv, env, cwd, out, err)


if __name__ == "__main__":
    serve()
