"""Signals and failing ranks under the example's launcher (issue 16, items 4 and 5), with real
processes: Ctrl+C (SIGINT to the launcher's process group, as a terminal sends it) stops every
rank, prints one line and keeps the CSV rows (and a loadable checkpoint with
``--save-on-interrupt``); ``kill -9`` of the agent takes its ranks with it; a rank that fails
is one line naming the rank. Ctrl+C during start-up (a rank at the rendezvous included) and a
second Ctrl+C during the first's cleanup (issue 29 §5): one line, no traceback, every rank
gone, nothing left in /dev/shm. Bounds are generous timeouts, never timing thresholds."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.rankpool import free_port

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ENV.pop("LOGLEVEL", None)
TINY = ["--model", "tiny", "--seq", "32", "--no-plot"]

pytestmark = pytest.mark.slow


def start(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    """``python examples/train_gpt.py`` in its own session, as a shell runs a job."""
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY]
    cmd += ["--out", str(tmp_path / "out"), *flags]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def rows(tmp_path: Path) -> list[dict[str, str]]:
    try:
        with open(tmp_path / "out" / "train_log.csv") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def wait_for_rows(proc: subprocess.Popen[str], tmp_path: Path, n: int = 2) -> None:
    deadline = time.monotonic() + 180
    while len(rows(tmp_path)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no CSV rows within 180 s"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


#: An interrupted run: its folder, exit status, stderr, and the rank pids still alive after it.
Interrupted = tuple[Path, int, str, list[int]]


@pytest.fixture(scope="module")
def interrupted_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Interrupted]:
    """The example on 2 ranks stopped by Ctrl+C after 2 CSV rows, with ``--save-on-interrupt``
    or without; run once per module: the checkpoint the interrupt saved is also the one the
    failing-rank test resumes with another model."""
    runs: dict[bool, Interrupted] = {}

    def run(save: bool) -> Interrupted:
        if save in runs:
            return runs[save]
        tmp_path = tmp_path_factory.mktemp(f"interrupted_save{int(save)}")
        flags = ["--steps", "100000"]
        if save:
            flags += ["--save-dir", str(tmp_path / "ckpt"), "--save-on-interrupt"]
        proc = start(tmp_path, *flags)
        wait_for_rows(proc, tmp_path)
        ranks = children(proc.pid)
        assert len(ranks) == 2, ranks
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl+C sends
        _out, err = proc.communicate(timeout=90)
        runs[save] = tmp_path, proc.returncode, err, [pid for pid in ranks if alive(pid)]
        return runs[save]

    return run


@pytest.mark.parametrize("save", [False, True])
def test_ctrl_c_stops_every_rank_with_one_line_and_keeps_the_log(
    interrupted_runs: Callable[[bool], Interrupted], save: bool
) -> None:
    tmp_path, returncode, err, left = interrupted_runs(save)
    assert returncode == 130, err
    assert not left, left
    assert "Traceback" not in err and "SignalException" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1, err
    kept = rows(tmp_path)
    assert kept and [int(r["step"]) for r in kept] == list(range(1, len(kept) + 1))
    assert lines[0].startswith(f"train_gpt: interrupted after step {len(kept)} of 100000: ")
    assert {"memory_mib_rank0", "memory_mib_rank1"} <= set(kept[0])  # every rank's memory
    assert all(float(r["memory_mib_rank1"]) > 0 for r in kept)
    # every other stderr line is the run's own (banner, progress bar), not torchrun's log
    assert not [line for line in err.splitlines() if "torch/distributed" in line], err
    if not save:
        assert "checkpoint" not in lines[0]
        return
    step = len(kept)
    assert f"checkpoint {tmp_path / 'ckpt'}/global_step{step}" in lines[0]
    # the checkpoint resumes: two more steps from where the interrupt left off
    resumed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY, "--steps",
         str(step + 2), "--resume", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out2")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stderr
    with open(tmp_path / "out2" / "train_log.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [step + 1, step + 2]


def test_kill_9_of_the_agent_takes_its_ranks_with_it(tmp_path: Path) -> None:
    proc = start(tmp_path, "--steps", "100000")
    wait_for_rows(proc, tmp_path)
    ranks = children(proc.pid)  # the launcher is torchrun's agent: the ranks are its children
    assert len(ranks) == 2, ranks
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "ranks ran on unsupervised after kill -9"
        time.sleep(0.2)
    assert rows(tmp_path)  # the rows written so far stay


def test_a_failing_rank_is_one_line_naming_the_rank(
    tmp_path: Path, interrupted_runs: Callable[[bool], Interrupted]
) -> None:
    # a real mistake that only shows inside the ranks: resuming a checkpoint of another model
    # (the tiny model's, saved on Ctrl+C)
    saved, returncode, err, _ = interrupted_runs(True)
    ckpt = saved / "ckpt"
    assert returncode == 130 and (ckpt / "latest").is_file(), err[-3000:]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--model", "small",
         "--seq", "32", "--no-plot", "--steps", "4", "--resume", str(ckpt),
         "--out", str(tmp_path / "o2")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode in (1, 2), proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("train_gpt: error: rank "), proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    tb = errors[0].rsplit("(traceback: ", 1)[1].rstrip(")")
    assert "Traceback" in Path(tb).read_text()  # the full story is kept, one path away


# ---------------------------------------------------------------------------------------------
# Ctrl+C during start-up, and a second Ctrl+C during the first's cleanup (issue 29 §5)


def shm_segments() -> set[str]:
    """The CPU backend's shared-memory segments now in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("ds_core-shm-*")}


def leaked(before: set[str]) -> list[str]:
    """Segments that appeared since ``before`` and that no live process maps (ours are all
    gone by then; other runs on this machine map theirs)."""
    new = shm_segments() - before
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped |= {name for name in new if name in text}
    return sorted(new - mapped)


def listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                return True
    return False


def starting(pid: int) -> bool:
    """Whether rank ``pid`` runs the script's start-up: past its first lines (``_ctypes`` is
    loaded by its imports, not by the interpreter's own start) and SIGINT not caught by a
    Python handler (the script leaves it to the kernel until the process group is up). Before
    that, in the interpreter's start (site packages), Python's fatal-error report of a
    KeyboardInterrupt is out of the script's reach."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    caught = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
    return "_ctypes" in maps and not caught & (1 << (signal.SIGINT - 1))


def test_ctrl_c_at_the_rendezvous_ends_a_waiting_rank_at_once(tmp_path: Path) -> None:
    """Rank 0 of 2 started alone waits at the rendezvous for a rank that never comes (the
    store listens on MASTER_PORT): Ctrl+C ends it at once, not after the 300 s timeout."""
    before = shm_segments()
    port = free_port()
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY]
    proc = subprocess.Popen(
        [*cmd, "--out", str(tmp_path / "out")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not listening(port):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no rendezvous within 180 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=60)  # a hang guard: the timeout it waited for is 300 s
    assert proc.returncode == -signal.SIGINT, err  # ended by the signal, as a shell shows it
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not leaked(before)


@pytest.mark.parametrize("twice", [False, True])
def test_ctrl_c_during_start_up_stops_every_rank_with_one_line(tmp_path: Path, twice: bool) -> None:
    before = shm_segments()
    proc = start(tmp_path, "--steps", "100000")
    deadline = time.monotonic() + 180
    while len(ranks := children(proc.pid)) < 2 or not all(map(starting, ranks)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no ranks starting within 180 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    if twice:
        os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert not any(alive(pid) for pid in ranks)
    assert "Traceback" not in err and "Error" not in err, err
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        "train_gpt: interrupted before the first step: nothing to keep"
    ], err
    assert not rows(tmp_path)
    assert not leaked(before)


def test_a_second_ctrl_c_during_the_first_cleanup(tmp_path: Path) -> None:
    """The second Ctrl+C lands while the ranks save on the first (``--save-on-interrupt``):
    still one line and status 130, every rank gone, nothing in /dev/shm, and ``latest`` (when
    the save got that far) names a checkpoint that verifies."""
    from ds_core.checkpoint import inspect_checkpoint

    before = shm_segments()
    ckpt = tmp_path / "ckpt"
    proc = start(tmp_path, "--steps", "100000", "--save-dir", str(ckpt), "--save-on-interrupt")
    wait_for_rows(proc, tmp_path)
    ranks = children(proc.pid)
    assert len(ranks) == 2, ranks
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 120
    while not (ckpt.is_dir() and any(ckpt.iterdir())):  # the save has begun
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no save within 120 s of the first Ctrl+C"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert not any(alive(pid) for pid in ranks)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and lines[0].startswith("train_gpt: interrupted "), err
    if (ckpt / "latest").exists():
        assert inspect_checkpoint(ckpt)["verified"] is True
    assert not leaked(before)
