"""tests/forkrank.py: a forked rank runs its command line as a fresh ``python`` would."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests import forkrank

pytestmark = pytest.mark.slow  # a server process that imports torch

CODE = """
import os, sys
print("argv", sys.argv[1:], "var", os.environ.get("FORKRANK_VAR"), "cwd", os.getcwd())
print("stray", "FORKRANK_STRAY" in os.environ, file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_code_gets_its_argv_environment_folder_and_exit_status(tmp_path: Path) -> None:
    os.environ["FORKRANK_STRAY"] = "1"  # in this process only: the child's env is what it is given
    try:
        env = {k: v for k, v in os.environ.items() if k != "FORKRANK_STRAY"}
        proc = forkrank.popen(["-c", CODE, "3", "x"], {**env, "FORKRANK_VAR": "v"}, cwd=tmp_path)
        out, err = proc.communicate(timeout=60)
    finally:
        del os.environ["FORKRANK_STRAY"]
    assert proc.returncode == 3
    assert out.strip() == f"argv ['3', 'x'] var v cwd {tmp_path}"
    assert err.strip() == "stray False"


def test_a_module_that_raises_exits_1_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "forkrank_boom.py").write_text("raise ValueError('boom')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    # the server's sys.path is fixed: put the module's folder first through -c
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import runpy; " + (
        "runpy.run_module('forkrank_boom', run_name='__main__')"
    )
    proc = forkrank.popen(["-c", code], env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "ValueError: boom" in err and "Traceback" in err


def test_kill_poll_and_wait_behave_as_popens(tmp_path: Path) -> None:
    proc = forkrank.popen(["-c", "import time; time.sleep(600)"], dict(os.environ))
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.kill()  # after the end: nothing to do, as Popen.kill


def test_err_equal_to_out_interleaves_both_in_one_file(tmp_path: Path) -> None:
    code = "import sys; print('a', flush=True); print('b', file=sys.stderr); print('c')"
    log = tmp_path / "both.log"
    proc = forkrank.popen(["-c", code], dict(os.environ), out=log, err=log)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.split() == ["a", "b", "c"] and err == ""


def test_pythonfaulthandler_dumps_the_stack_of_a_crash(tmp_path: Path) -> None:
    # a fresh interpreter reads it at start; a forked rank must get the same stacks in its log
    code = "import os, signal\ndef crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\ncrash()\n"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = forkrank.popen(["-c", code], env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in err and "in crash" in err, err


def test_what_acts_at_process_start_is_refused_not_ignored() -> None:
    # glibc reads MALLOC_* when the process starts: a forked child would silently run without
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    assert forkrank.not_applied(env) == ["MALLOC_MMAP_THRESHOLD_"]
    with pytest.raises(ValueError, match="MALLOC_MMAP_THRESHOLD_"):
        forkrank.popen(["-c", "pass"], env)
    assert forkrank.not_applied(dict(os.environ, PYTHONFAULTHANDLER="1", RANK="3")) == []
