"""A fork server: heavy modules imported once, then one forked child per run.

A run of ``ds-core conformance`` or of pytest in a fresh interpreter spends most of its CPU
time importing torch, ds_core and pytest (about 2 of 3 CPU seconds for a narrowed category on
2 cores); the tests that run the CLI once per broken backend (tests/test_conformance_broken.py)
and the mutation tool (tools/conformance_mutation.py: several suite runs per mutant) pay that
on every run. :class:`ForkServer` starts one server process that imports ``preload`` once and
then, per request, forks a child that calls ``module:function(args)`` as the script's entry
point would and exits with its status through the interpreter's normal exit (atexit handlers
run).

What a child shares with a fresh interpreter's run: the preloaded modules. They must not
select a backend nor read the ``DS_*`` environment at import, and the server must start no
thread (a fork copies only the forking thread: a thread started by an import would be missing
in every child, and any lock it held, held forever) -- both checked before it serves;
``forbid`` names module prefixes that must not be preloaded (the mutation tool's backend under
test, which each child imports afresh from the mutated copy). What it does not prove: the
console entry point's own start-up, which runs of the CLI in a fresh interpreter cover.

Each child runs in its own process group: the server kills the group when the child is done
(rank processes it left behind) or when it passes its timeout.

    request: {"call": "pkg.mod:func", "args": [...], "env": {...}, "replace_env": bool,
              "path": DIR | null, "cwd": DIR | null, "output": FILE, "timeout": S}
    replies: {"pid": PID}, then {"code": INT | null, "seconds": S} (null: past its timeout)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the run; never returns."""
    os.setpgid(0, 0)  # a group of its own, which the server kills whole
    if request["replace_env"]:
        os.environ.clear()
    os.environ.update(request["env"])
    if request["path"]:
        sys.path.insert(0, request["path"])
        importlib.invalidate_caches()  # modules and dist-info that appeared after the imports
    if request["cwd"]:
        os.chdir(request["cwd"])
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    module, _, name = request["call"].partition(":")
    sys.argv = [module, *request["args"]]
    sys.exit(getattr(importlib.import_module(module), name)(list(request["args"])))


def serve(preload: Sequence[str], forbid: Sequence[str]) -> None:
    """Import ``preload``, then fork one child per request line on stdin."""
    for name in preload:
        importlib.import_module(name)
    early = sorted(m for m in sys.modules if m.startswith(tuple(forbid))) if forbid else []
    if early:
        raise SystemExit(f"the fork server imported {early} before forking; it must not")
    if threading.active_count() != 1:
        raise SystemExit(f"the fork server has threads before forking: {threading.enumerate()}")
    replies = os.dup(1)  # each child's fd 1 becomes its output file

    def reply(message: dict[str, Any]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(replies)
            _child(request)
        reply({"pid": pid})
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
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        if code is None:
            os.waitpid(pid, 0)
        reply({"code": code, "seconds": time.monotonic() - start})


class ForkServer:
    """The client: starts the server in ``env`` (default: this process's environment with its
    ``sys.path`` as ``PYTHONPATH``); :meth:`close` ends it."""

    def __init__(
        self,
        preload: Sequence[str],
        env: dict[str, str] | None = None,
        forbid: Sequence[str] = (),
        cwd: Path | None = None,
    ) -> None:
        if env is None:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        cmd = [sys.executable, __file__, "--preload", ",".join(preload)]
        if forbid:
            cmd += ["--forbid", ",".join(forbid)]
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.child: int | None = None  # the run in flight: its process group
        if not self._answer():
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")

    def run(
        self,
        call: str,
        args: Sequence[str],
        output: Path,
        timeout: float,
        env: dict[str, str] | None = None,
        replace_env: bool = False,
        path: Path | None = None,
        cwd: Path | None = None,
    ) -> int | None:
        """Run ``call`` (``"module:function"``, given ``args``) in a forked child.

        :param output: the file that receives the run's stdout and stderr.
        :param timeout: seconds before the run is killed with its process group.
        :param env: variables set for the run (its whole environment with ``replace_env``).
        :param path: a folder put first on the run's ``sys.path``.
        :param cwd: the run's working directory (default: the server's).
        :returns: the run's exit status, ``None`` when it ran past ``timeout``.
        :raises RuntimeError: the server died.
        """
        request = {
            "call": call,
            "args": list(args),
            "env": env or {},
            "replace_env": replace_env,
            "path": str(path) if path else None,
            "cwd": str(cwd) if cwd else None,
            "output": str(output),
            "timeout": timeout,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self.child = self._answer()["pid"]
        code: int | None = self._answer()["code"]
        self.child = None
        return code

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        """Stop the server; a run still going (an interrupted caller) is killed with its group."""
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child, signal.SIGKILL)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preload", default="", help="modules to import once, comma-separated")
    parser.add_argument("--forbid", default="", help="module prefixes that must not be loaded")
    opts = parser.parse_args()
    serve([m for m in opts.preload.split(",") if m], [m for m in opts.forbid.split(",") if m])
