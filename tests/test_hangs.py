"""Hangs become errors (issue 29 §4): a rank whose calls disagree with its peers' ends the run
with one line per rank naming the rank and the call, never a wait for the transport's timeout.

The check: ds_core/hangs.py; the rule: docs/architecture.md §3.10. Each case runs two fresh
rank processes (ranks leave by ``os._exit``) of tests/_hangs_rank.py, on the cpu and the sim
backend. Time bounds: the process group's timeout there is 900 s and ``DS_HANG_TIMEOUT_S``
keeps its default of 600 s, so a pair ending within :data:`GUARD_S` (far above the liveness
bound of ``MISSES`` x ``PERIOD_S`` = 5 s, far below both) was ended by a definite verdict, not
by a timeout; no test measures a duration.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ds_core import hangs
from ds_core.comm import liveness
from ds_core.errors import ConfigError
from tests import forkrank

ROOT = Path(__file__).resolve().parents[1]
# A 5 s bound, the liveness suite's for engine ranks, in 20 of this rank's own ticks: a loaded
# host that delays the watcher's thread delays its count as well (ds_core/comm/liveness.py),
# so a peer is not blamed for the host's load. Every fault case waits the bound out once,
# and the compute and timeout cases a few periods past it; nothing asserted depends on its
# length, and the production defaults are asserted by reading them (test_liveness.py).
PERIOD_S, MISSES = 0.25, 20
GUARD_S = 300
BACKENDS = ["cpu", "sim"]
LINE = re.compile(r"^ds_core: .*; exiting$", re.M)
NO_MODEL = r"RuntimeError: backward\(loss\): the loss reached none of the model's"
DOUBLE = r"RuntimeError: step\(\): no engine.backward\(loss\) since the last update"
#: case -> per rank (0, 1): (exit status, pattern its one line must match, or None for no line)
CASES: dict[str, tuple[tuple[int, str | None], tuple[int, str | None]]] = {
    "skip_step": (
        (hangs.EXIT_CODE, r"ranks disagree at call #\d+ on world: rank 0 issued all_reduce"),
        (hangs.EXIT_CODE, r"ranks disagree at call #\d+ on world: rank 1 issued reduce_scatter"),
    ),
    "some_only": (
        (hangs.EXIT_CODE, r"ranks disagree at call #\d+ on world: rank 0 issued reduce_scatter"),
        (hangs.EXIT_CODE, r"ranks disagree at call #\d+ on world: rank 1 issued all_reduce"),
    ),
    "micro_batches": (
        (0, None),
        (
            hangs.EXIT_CODE,
            r"rank 0 left the run \(destroy_distributed\) after \d+ calls on world, but rank 1 "
            r"issued call #\d+ \(reduce_scatter\) there and waits in .*micro-batch \d of 2",
        ),
    ),
    "leave_early": (
        (
            hangs.EXIT_CODE,
            r"rank 1 left the run \(destroy_distributed\) after \d+ calls on world, but rank 0 "
            r"issued call #\d+ \(\w+\) there and waits in .*step 2, micro-batch 1 of 1",
        ),
        (0, None),
    ),
    "finally_leave": (
        (
            hangs.EXIT_CODE,
            r"rank 1 left the run \(destroy_distributed while ValueError: the culprit's own "
            r"error propagated\) after \d+ calls on world, but rank 0 issued call #\d+",
        ),
        (1, None),
    ),
    "no_model": ((liveness.EXIT_CODE, rf"rank 1 \(host [^)]*\) .*\({NO_MODEL}"), (1, None)),
    "double_step": ((liveness.EXIT_CODE, rf"rank 1 \(host [^)]*\) .*\({DOUBLE}"), (1, None)),
}
#: what a culprit that raised must print (its own traceback ends in it)
OWN_ERROR = {
    "no_model": NO_MODEL,
    "double_step": DOUBLE,
    "finally_leave": "ValueError: the culprit's own error",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(case: str, backend: str, work: Path, **extra: str) -> list[tuple[int, str]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": backend,
            "OMP_NUM_THREADS": "1",
            "DS_LIVENESS_PERIOD_S": str(PERIOD_S),
            "DS_LIVENESS_MISSES": str(MISSES),
            **extra,
        }
        if "DS_HANG_TIMEOUT_S" not in extra:
            env.pop("DS_HANG_TIMEOUT_S", None)  # the default: far above GUARD_S
        # forked from a server that imported torch and ds_core (tests/forkrank.py): the
        # pair's time goes to the fault, not to two interpreters' start-up
        procs.append(forkrank.popen(["-m", "tests._hangs_rank", case, str(work)], env=env))
    out = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        out.append((proc.returncode, err))
    return out


def _no_shm_left(work: Path) -> None:
    for record in work.glob("shm.rank*.json"):
        left = [p for p in json.loads(record.read_text()) if os.path.exists(p)]
        assert not left, (record.name, left)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_ends_every_rank_with_one_line(case: str, backend: str, tmp_path: Path) -> None:
    results = _pair(case, backend, tmp_path)
    for rank, ((rc, err), (want_rc, pattern)) in enumerate(zip(results, CASES[case], strict=True)):
        lines = LINE.findall(err)
        if want_rc == 1:  # the culprit's own error: its exit past the traceback is not ours
            assert rc != 0, f"rank {rank}: {err[-4000:]}"
        else:
            assert rc == want_rc, f"rank {rank}: {err[-4000:]}"
        if pattern is None:
            assert not lines, f"rank {rank}: {err[-4000:]}"
            if want_rc == 1:  # the culprit's own error, from its traceback
                assert re.search(OWN_ERROR[case], err), err[-4000:]
            continue
        assert len(lines) == 1, f"rank {rank}: {err[-4000:]}"
        assert re.search(pattern, lines[0]), lines[0]
        if want_rc == hangs.EXIT_CODE:  # liveness's own lines name this rank their way
            assert f"; this rank is {rank} (in " in lines[0], lines[0]
        assert "Traceback" not in err, err[-4000:]
    _no_shm_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_computing_longer_than_the_liveness_bound_is_not_reported(
    backend: str, tmp_path: Path
) -> None:
    # rank 0 computes the bound and 6 periods more before one backward while rank 1 waits in
    # a collective (entered milliseconds after rank 0's sleep began): rank 1 is blocked past
    # the bound for several periods, each deciding that a computing peer is no hang (more
    # sleeps, or longer ones, would only repeat that decision)
    sleep = str((MISSES + 6) * PERIOD_S)
    results = _pair("compute", backend, tmp_path, SLEEP_S=sleep)
    for rank, (rc, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {err[-4000:]}"
        assert not LINE.search(err), err[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("backend", [*BACKENDS, "sim-lazy"])
def test_a_rank_computing_past_the_hang_timeout_is_reported(backend: str, tmp_path: Path) -> None:
    # above the bound, as Settings.from_env requires, by 2 periods: the verdict waits for the
    # timeout, every period past the bound deciding that waiting is still legitimate. On sim
    # the waiting rank's host blocks in a device wait (its collective is queued on a stream),
    # not in a collective's call; under DS_SIM_ASYNC=lazy the backend runs the collective,
    # polling, inside that wait.
    timeout = (MISSES + 2) * PERIOD_S
    mode = {"DS_SIM_ASYNC": "lazy"} if backend == "sim-lazy" else {}
    results = _pair(
        "slow",
        backend.removesuffix("-lazy"),
        tmp_path,
        SLEEP_S=str(GUARD_S),
        DS_HANG_TIMEOUT_S=str(timeout),
        **mode,
    )
    (rc0, err0), (rc1, err1) = results
    assert (rc0, rc1) == (hangs.EXIT_CODE, hangs.EXIT_CODE), err0[-3000:] + err1[-3000:]
    found = LINE.findall(err1)
    assert len(found) == 1, err1[-4000:]
    assert re.search(
        r"rank 0 has not issued call #\d+ \(\w+\) on world for \d+ s \(it issued \d+; it is in "
        rf".*\), while rank 1 waits in .*\(DS_HANG_TIMEOUT_S={timeout:g}\)",
        found[0],
    ), found[0]
    assert len(LINE.findall(err0)) == 1 and "Traceback" not in err0, err0[-4000:]


def test_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_HANG_CHECK", "maybe")
    with pytest.raises(ConfigError, match="DS_HANG_CHECK='maybe'"):
        hangs.Settings.from_env(10.0)
    monkeypatch.setenv("DS_HANG_CHECK", "0")
    assert not hangs.Settings.from_env(10.0).enabled
    monkeypatch.setenv("DS_HANG_TIMEOUT_S", "5")
    with pytest.raises(ConfigError, match=r"DS_HANG_TIMEOUT_S='5'.*above the liveness bound"):
        hangs.Settings.from_env(10.0)
    monkeypatch.setenv("DS_HANG_TIMEOUT_S", "ten")
    with pytest.raises(ConfigError, match="DS_HANG_TIMEOUT_S='ten'"):
        hangs.Settings.from_env(10.0)
    monkeypatch.delenv("DS_HANG_TIMEOUT_S")
    assert hangs.Settings.from_env(10.0).timeout_s == 600.0


def _record(channels: dict[str, list[object]], **kw: object) -> dict[str, object]:
    return {"ch": channels, "stall": 0.0, "ctx": "", **kw}


def test_the_decision_rules_on_records() -> None:
    """The verdict functions on hand-made records: a mismatch at one call number, a
    deadlock cycle, a peer behind that computes (no verdict), a p2p pair in step."""
    world = [0, 1]
    ar, rs = ["all_reduce", 4, "torch.float32"], ["reduce_scatter", 8, "torch.float32"]
    mine = _record({"world": [world, 3, [[0, *ar], [1, *ar], [2, *ar]]]}, phase="x")
    other = _record({"world": [world, 3, [[0, *ar], [1, *ar], [2, *rs]]]}, phase="y")
    text = hangs._mismatch(0, {0: mine, 1: other})
    assert text is not None and text.startswith("ranks disagree at call #2 on world")
    same = _record({"world": [world, 2, [[0, *ar], [1, *ar]]]})
    assert hangs._mismatch(0, {0: mine, 1: same}) is None
    # all_to_all sizes may differ per rank
    a2a = _record({"world": [world, 1, [[0, "all_to_all", None, "torch.float32"]]]})
    assert hangs._mismatch(0, {0: a2a, 1: a2a}) is None
    # rank 0 waits in call #2 that rank 1 has not issued: rank 1 is what it waits on
    mine["blocked"] = ["world", 2, "all_reduce"]
    assert hangs._waits_on(0, {0: mine, 1: same}) == [(1, "world", 2, "all_reduce")]
    # everyone issued it: no one to wait on (the transport's business)
    assert hangs._waits_on(0, {0: mine, 1: other}) == []
    # p2p: the sender's channel matched by as many receives is in step
    send = _record({"p2p 0->1": [world, 2, [[0, "send", 4, "f"], [1, "send", 4, "f"]]]})
    recv = _record({"p2p 0->1": [world, 2, [[0, "recv", 4, "f"], [1, "recv", 4, "f"]]]})
    assert hangs._mismatch(0, {0: send, 1: recv}) is None
    assert hangs._waits_on(0, {0: send, 1: recv}) == []


class _Records:
    """A store holding hand-made ``prog/<rank>`` records (what Checker.decide reads)."""

    def __init__(self, recs: dict[int, dict[str, object]]) -> None:
        self.values = {f"t/prog/{r}": json.dumps(rec).encode() for r, rec in recs.items()}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[k] for k in keys]


def test_a_device_wait_with_no_call_missing_is_computing() -> None:
    """On an async device a stalled host counts as blocked (its queued work may hold a
    collective), but a peer stalled so whose calls every member issued computes: the waiting
    rank's verdict is the hang timeout's, not "everyone issued it" (never reported)."""
    settings = liveness.Settings(period_s=0.5, misses=4)
    world, rs = [0, 1], ["reduce_scatter", 8, "torch.float32"]
    ahead = _record({"world": [world, 3, [[0, *rs], [1, *rs], [2, *rs]]]}, comm=True, device=True)
    behind = _record({"world": [world, 2, [[0, *rs], [1, *rs]]]}, comm=True, device=True)
    for rec in (ahead, behind):
        rec.update(stall=30.0, phase="optimizer step")
    watchdog = type("W", (), {"rank": 1, "ns": "t/", "settings": settings})()
    watchdog.store = _Records({0: behind})
    checker = hangs.Checker(watchdog, hangs.Settings(timeout_s=20.0), device_waits=True)
    text = checker.decide(dict(ahead))
    assert text is not None and text.startswith("rank 0 has not issued call #2 (reduce_scatter)")
    assert "DS_HANG_TIMEOUT_S=20" in text, text
    # within the timeout the waiting goes on
    assert hangs.Checker(watchdog, hangs.Settings(timeout_s=60.0), True).decide(ahead) is None
    # a peer that waits in a call this rank has not issued is blocked: a deadlock at once
    other = _record({"p2p 0->1": [world, 1, [[0, "send", 4, "f"]]]}, comm=True, device=True)
    behind["ch"] = {**behind["ch"], **other["ch"]}  # type: ignore[dict-item]
    watchdog.store = _Records({0: behind})
    text = hangs.Checker(watchdog, hangs.Settings(timeout_s=60.0), True).decide(ahead)
    assert text is not None and text.startswith("deadlock: rank 1 waits in call #2"), text


_SAMPLER = """
import sys, threading
from ds_core import hangs
from ds_core.comm import liveness
errors, done = [], threading.Event()
def sample():
    while not done.is_set():
        frame = sys._current_frames().get(threading.main_thread().ident)
        try:
            hangs._in_comm(frame)
            liveness.main_thread_phase()
        except Exception as exc:
            errors.append(repr(exc))
thread = threading.Thread(target=sample, daemon=True)
thread.start()
import torch._dynamo, torch.distributed  # many fresh frames, some caught before their first line
done.set()
thread.join()
print(errors[:3])
"""


def test_reading_the_main_thread_while_it_imports_never_raises() -> None:
    """The watchdog thread reads the main thread's frames at any moment; a frame caught before
    its first line has ``f_lineno`` None (the hang check raised TypeError on it, which the
    watchdog took for a dead store: a healthy run ended naming rank 0's host)."""
    proc = subprocess.run(
        [sys.executable, "-c", _SAMPLER], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


class _Store:
    def __init__(self) -> None:
        self.keys: list[str] = []

    def set(self, key: str, value: str) -> None:
        self.keys.append(key)


def test_a_record_that_cannot_be_read_skips_the_period(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tick() raises nothing for a record it cannot read (the watchdog would blame the store),
    publishes nothing that period, and says so once after a bound of periods in a row."""
    settings = liveness.Settings(period_s=0.5, misses=3)
    watchdog = type("W", (), {"rank": 1, "store": _Store(), "ns": "t/", "settings": settings})()
    checker = hangs.Checker(watchdog, hangs.Settings(), device_waits=False)

    def unreadable(now: float, left: bool = False) -> dict[str, object]:
        raise TypeError("'<=' not supported between instances of 'int' and 'NoneType'")

    real = checker.record
    monkeypatch.setattr(checker, "record", unreadable)
    for tick in range(4):
        checker.tick(float(tick))
    assert watchdog.store.keys == []
    err = capsys.readouterr().err
    assert err.count("could not read this rank's state for 3 periods (TypeError") == 1, err
    monkeypatch.setattr(checker, "record", real)
    checker.tick(5.0)
    assert watchdog.store.keys == ["t/prog/1"] and checker.misreads == 0
