"""A fork server for the mutation tool: pytest, torch and ds_core imported once, one fork a run.

Each suite run of a mutant otherwise starts an interpreter and imports pytest and torch
(seconds each on a loaded host) before the first check. The server imports them (but never the
backend under test, so each fork imports the mutated copy afresh), then for each request read
from stdin forks a child that runs ``pytest.main`` in its own process group and answers with
its exit code (``null`` when it ran past the request's timeout: the group is killed).

    request:  {"args": [...], "cwd": DIR, "env": {NAME: VALUE}, "log": FILE, "timeout": S}
    answer:   {"code": INT | null, "seconds": S}
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _child(request: dict[str, object]) -> None:
    os.setpgid(0, 0)
    fd = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(str(request["cwd"]))
    os.environ.update(request["env"])  # type: ignore[arg-type]
    code = 3
    try:
        import pytest

        code = int(pytest.main(list(request["args"])))  # type: ignore[call-overload]
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    import ds_conformance.plugin  # noqa: F401
    import pytest  # noqa: F401  (imported once, shared by every fork)
    import torch  # noqa: F401

    import ds_core  # noqa: F401

    assert not any(m.startswith("ds_backend_") for m in sys.modules), "backend imported early"
    print(json.dumps({"ready": True}), flush=True)
    for text in sys.stdin:
        request = json.loads(text)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        deadline = start + float(request["timeout"])
        code: int | None = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        try:  # the group: stray rank workers of a finished run, everything on a timeout
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code is None:
            os.waitpid(pid, 0)
        answer = {"code": code, "seconds": time.monotonic() - start}
        print(json.dumps(answer), flush=True)


class ForkServer:
    """The server (this file) run in ``env``: the copy under test first on ``PYTHONPATH``."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.child: int | None = None  # the run in flight: its process group
        assert self.proc.stdout is not None and self.proc.stdin is not None
        if not self.proc.stdout.readline():
            raise SystemExit("the fork server did not start (run with --no-fork to see why)")

    def run(
        self, args: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float
    ) -> int | None:
        """pytest's exit code, ``None`` past ``timeout`` seconds."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"args": args, "cwd": str(cwd), "env": env, "log": str(log), "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self.proc.stdout.readline()
        self.child = json.loads(started)["pid"] if started else None
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit("the fork server died")
        self.child = None
        code: int | None = json.loads(answer)["code"]
        return code

    def close(self) -> None:
        """Stop the server; a run still going (an interrupted tool) is killed with its group."""
        assert self.proc.stdin is not None
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    _serve()
