"""Runs of ``ds-core`` forked from one interpreter that has imported torch and ds_core.

A ``ds-core conformance`` run in a fresh interpreter spends most of its CPU time importing
torch, ds_core and pytest (about 2 of 3 CPU seconds for a narrowed category on 2 cores); a
file that runs the CLI once per case (tests/test_conformance_broken.py: 51 cases) pays that
51 times. :class:`CliForks` starts one server process that imports them once, then forks a
child per run: the child takes the run's environment and ``sys.path`` entry, calls
:func:`ds_core.cli.main` as ``python -m ds_core.cli`` would, writes its output to a file and
exits with the command's status through the interpreter's normal exit (atexit handlers run).

What a fork shares with a fresh interpreter's run: the modules imported before the fork
(torch, ds_core, pytest, ds_conformance.runner: none of them selects a backend or reads the
``DS_*`` environment at import, and the server starts no thread, checked before it serves).
What it does not prove: the console entry point's own start-up, which the files that run the
CLI in a fresh interpreter cover (tests/test_conformance.py, the other cases of
tests/test_conformance_broken.py).

Server side: ``python -m tests.clifork`` (one JSON request a line on stdin; ``<pid>`` then
``<pid> <status>`` lines on stdout).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import ds_conformance.runner
import pytest
import torch

from ds_core import cli

#: what every run imports, loaded once by the server before it forks (and by the client,
#: which has them already)
PRELOADED = (torch, pytest, cli, ds_conformance.runner)
ROOT = Path(__file__).resolve().parents[1]


class CliForks:
    """A server process forking ``ds-core`` runs; :meth:`close` (or the end of the test
    process) ends it."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.clifork"],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[str] = self._proc.stdin
        self._stdout: IO[str] = self._proc.stdout
        self._fd = self._stdout.fileno()
        self._buffer = b""

    def run(
        self, argv: list[str], env: dict[str, str], site: Path, output: Path, timeout: float
    ) -> int:
        """Run ``ds-core *argv`` with ``env`` as its whole environment and ``site`` first on
        its ``sys.path``; its stdout and stderr go to ``output``. Returns its exit status.

        :raises subprocess.TimeoutExpired: the run took more than ``timeout`` seconds (it is
            killed with its process group).
        :raises RuntimeError: the server died.
        """
        request = {"argv": argv, "env": env, "site": str(site), "output": str(output)}
        self._stdin.write(json.dumps(request) + "\n")
        self._stdin.flush()
        pid = int(self._line(timeout=60.0))
        try:
            done = self._line(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)  # the run and the rank processes it started
            self._line(timeout=60.0)
            raise
        child, status = done.split()
        assert int(child) == pid, (child, pid)
        return int(status)

    def _line(self, timeout: float) -> str:
        # Unbuffered reads: a buffered reader could hold both reply lines while select()
        # waits on the pipe for the second.
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("tests.clifork", timeout)
            chunk = os.read(self._fd, 4096)
            if not chunk:
                raise RuntimeError(f"the ds-core fork server exited ({self._proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        self._stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stdout.close()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m ds_core.cli *argv``; never returns."""
    os.setpgid(0, 0)  # a group of its own, which a timeout kills whole
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path.insert(0, request["site"])
    importlib.invalidate_caches()  # the site's dist-info and modules appeared after the imports
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    sys.argv = ["ds-core", *request["argv"]]
    sys.exit(cli.main(request["argv"]))


def serve() -> None:
    """Fork one child per request line on stdin (:data:`PRELOADED` imported)."""
    # A fork copies only the forking thread: a thread started by an import would be missing
    # (and any lock it held, held forever) in every child.
    assert threading.active_count() == 1, threading.enumerate()
    proto = os.dup(1)  # replies; the children's fd 1 becomes their output file
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(proto)
            _child(request)
        os.write(proto, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(proto, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    serve()
