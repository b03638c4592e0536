"""The CPU backend's shared-memory collectives: results equal gloo's, safety, crashes.

Ranks are real processes (``tests/_shm_rank.py``). Small slots (``DS_CPU_SHM_SLOT_BYTES``)
make modest tensors cross many pieces, so the multi-piece paths run without big buffers.
``DS_SHM_STRESS_COUNT`` raises the stress test's number of random collectives (default 300).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
from ds_backend_cpu import shm_segment, shm_sync

from tests import forkrank
from tests.rankpool import rank_env

HANG_GUARD_S = 600  # only against a hang; never a speed check


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(scenario: str, world: int, **env: str) -> list[forkrank.Forked]:
    """``world`` ranks of ``scenario``, forked from a server that imported torch and ds_core
    (tests/forkrank.py): a case's time goes to the transport, not to interpreters' start-up."""
    port = _port()
    procs = []
    for rank in range(world):
        env_r = {
            **os.environ,
            **rank_env(rank, world, port, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"),
            **env,
        }
        procs.append(forkrank.popen(["-m", "tests._shm_rank", scenario], env_r))
    return procs


def _results(procs: list[forkrank.Forked]) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=HANG_GUARD_S)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _run(scenario: str, world: int, **env: str) -> list[dict[str, Any]]:
    results = []
    for rank, (code, stdout, stderr) in enumerate(_results(_launch(scenario, world, **env))):
        ok = [line for line in stdout.splitlines() if line.startswith("OK ")]
        assert code == 0 and ok, f"rank {rank} exited {code}:\n{stdout}\n{stderr[-4000:]}"
        results.append(json.loads(ok[-1][3:]))
    return results


def _paths() -> list[tuple[str, dict[str, str]]]:
    """The sync paths to test: the C helper when it builds here, and always the Python one."""
    paths = [("python", {shm_sync.ENV_SYNC: "python"})]
    if shm_sync.c_helper()[0] is not None:
        paths.insert(0, ("c", {}))
    return paths


@pytest.mark.slow  # real rank processes
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path", _paths(), ids=lambda p: p[0])
def test_every_collective_op_and_dtype_matches_gloo(
    world: int, path: tuple[str, dict[str, str]]
) -> None:
    results = _run("match", world, DS_CPU_SHM_SLOT_BYTES="8192", **path[1])
    for r in results:
        assert r["gloo_reasons"] == [], r  # every call took the shared-memory path
        assert r["shm_calls"] > 500


@pytest.mark.slow  # real rank processes
def test_large_slots_match_gloo() -> None:
    """The default slot size, where most calls fit one piece."""
    results = _run("match", 2)
    assert all(r["shm_calls"] > 500 and not r["gloo_reasons"] for r in results)


@pytest.mark.slow  # real rank processes
@pytest.mark.parametrize("world", [2, 4])
def test_stress_random_collectives_match_gloo(world: int) -> None:
    results = _run("stress", world, DS_CPU_SHM_SLOT_BYTES="16384")
    assert all(not r["gloo_reasons"] for r in results), results
    # every draw runs on at least one rank; barriers are not counted as checked calls
    assert sum(r["checked"] for r in results) > results[0]["count"] * 2 // 3, results


@pytest.mark.slow  # real rank processes
def test_mismatched_calls_raise_naming_the_field_on_every_rank() -> None:
    results = _run("mismatch", 2)
    for rank, r in enumerate(results):
        errors = dict(e.split(": ", 1) for e in r["errors"])
        peer = f"rank {1 - rank}"
        assert "numel=10" in errors["numel"] and "numel=11" in errors["numel"]
        assert "torch.float64" in errors["dtype"] and peer in errors["dtype"]
        assert "op=max" in errors["op"] and "op=sum" in errors["op"]
        assert "collective=broadcast" in errors["collective"]
        assert "shape=(2, 6)" in errors["shape"] and "shape=(6, 2)" in errors["shape"]
        assert "sends 2 rows to rank 1, which expects 1" in errors["rows"]
        assert "all_gather output has 5 elements" in errors["elements"] or (
            "rank 1 rejected its arguments" in errors["elements"]
        )


@pytest.mark.slow  # real rank processes
@pytest.mark.parametrize("victim", [0, 2])
def test_kill9_of_a_rank_is_named_and_leaves_dev_shm_clean(victim: int) -> None:
    procs = _launch("kill", 3, DS_SHM_VICTIM=str(victim), DS_CPU_SHM_TIMEOUT="300")
    results = _results(procs)
    segments = {
        line.split()[1]
        for _, out, _ in results
        for line in out.splitlines()
        if line.startswith("SEGMENT")
    }
    assert len(segments) == 1, results
    for rank, (code, stdout, stderr) in enumerate(results):
        if rank == victim:
            assert code == -signal.SIGKILL
            continue
        assert code == 0, stderr[-4000:]
        error = json.loads(stdout.splitlines()[-1][3:])["error"]
        assert f"rank {victim} (pid" in error and "exited" in error, error
    assert not any(Path(p).exists() for p in segments)


@pytest.mark.slow  # real rank processes
def test_stalled_peer_is_named_within_the_timeout() -> None:
    procs = _launch("stall", 2, DS_CPU_SHM_TIMEOUT="3")
    code, stdout, stderr = _results(procs[:1])[0]
    procs[1].kill()
    procs[1].wait()
    assert code == 0, stderr[-4000:]
    result = json.loads(stdout.splitlines()[-1][3:])
    assert "rank 1 (pid" in result["error"] and "within 3 s" in result["error"]


@pytest.mark.slow  # real rank processes
def test_unsupported_tensors_fall_back_to_gloo_with_a_reason() -> None:
    results = _run("fallback", 2)
    for r in results:
        reasons = {(c[0], c[1], c[2]) for c in r["counts"]}
        assert ("broadcast", "gloo", "dtype torch.complex64") in reasons
        # the transposed all_reduce is staged contiguous by the facade, so it stays on shm
        assert ("all_reduce", "shm", "") in reasons
        assert not any(c == "all_reduce" and t == "gloo" for c, t, _ in reasons), reasons


@pytest.mark.slow  # real rank processes
def test_disabled_groups_use_gloo_and_say_why() -> None:
    results = _run("fallback", 2, DS_CPU_SHM="0")
    for r in results:
        assert r["shm_calls"] == 0
        assert r["gloo_reasons"] == ["rank 0: DS_CPU_SHM=0"], r


@pytest.mark.slow  # real rank processes
def test_async_first_call_on_a_group_does_not_wait_for_peers(tmp_path: Path) -> None:
    results = _run("async_first", 2, DS_SHM_MARKER=str(tmp_path / "returned"))
    assert all(r["shm_calls"] >= 1 and not r["gloo_reasons"] for r in results), results


@pytest.mark.slow  # real rank processes
def test_require_turns_a_fallback_into_an_error() -> None:
    for r in _run("require", 2, DS_CPU_SHM_REQUIRE="1"):
        assert "dtype torch.complex64" in r["error"] and "DS_CPU_SHM_REQUIRE=1" in r["error"]


# --------------------------------------------------------------------------- segments


def test_segment_is_owner_only_with_an_unguessable_name() -> None:
    layout = shm_segment.Layout(2, 4096)
    a, b = shm_segment.create(layout), shm_segment.create(layout)
    try:
        for s in (a, b):
            st = os.stat(s.path)
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
            assert st.st_size == layout.size
        suffix = len(Path(a.path).name) - len(shm_segment.PREFIX)
        assert suffix == 32 and a.path != b.path  # 128 random bits each
        peer = shm_segment.attach(a.path, layout)
        peer.bytes[0] = 7
        assert int(a.bytes[0]) == 7  # one memory
    finally:
        a.unlink()
        b.unlink()
    assert not os.path.exists(a.path) and not os.path.exists(b.path)
    assert int(peer.bytes[0]) == 7  # the mapping outlives the name


def test_attach_refuses_segments_others_could_reach(tmp_path: Path) -> None:
    layout = shm_segment.Layout(2, 4096)
    seg = shm_segment.create(layout)
    try:
        os.chmod(seg.path, 0o644)
        with pytest.raises(shm_segment.SegmentError, match="mode 644, expected 600"):
            shm_segment.attach(seg.path, layout)
        os.chmod(seg.path, 0o600)
        with pytest.raises(shm_segment.SegmentError, match="bytes, expected"):
            shm_segment.attach(seg.path, shm_segment.Layout(2, 8192))
        with pytest.raises(shm_segment.SegmentError, match="not a ds_core segment"):
            shm_segment.attach(str(tmp_path / "x"), layout)
    finally:
        seg.unlink()
