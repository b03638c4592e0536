"""Full or failing disks at each save kind: the error names the path and the bytes needed, and
the previous checkpoint stays the ``latest``, byte for byte.

Issue 29 §3. Each case runs in a child process (tests/_faults_worker.py) that saves checkpoint
``A`` and then faults the next write:

- ``fsize``: ``RLIMIT_FSIZE`` of 64 KiB (``SIGXFSZ`` ignored in the child, so the write fails
  with ``EFBIG`` instead of the signal killing the process), on every machine;
- ``enospc``: the checkpoint folder is a tmpfs remounted to 64 KiB above what it holds;
- ``erofs``: the same tmpfs remounted read-only.

The tmpfs cases run in a private mount namespace (``unshare -m``, root only: skipped, naming
why, where it is unavailable). Kinds: a native save, a universal save, an export
(``export_checkpoint`` to ``.safetensors``), a conversion to the universal format, and an NVMe
swap-out during the optimizer step (the swap folder on the tmpfs, remounted read-only).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._faults_worker import assert_nothing_lost
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = [b for b in installed_backends() if b in ("cpu", "sim-threads")]
SAVES = ["native", "universal", "export", "convert"]
DIM, LAYERS = 256, 2
#: parameters of the worker's model, and the bytes each kind must say it needs: fp32 masters
#: and Adam's two moments (a save, a conversion's copy of the source), or fp32 weights (export)
NUMEL = LAYERS * (DIM * DIM + DIM)
NEEDED = {"native": 12 * NUMEL, "universal": 12 * NUMEL, "export": 4 * NUMEL}
ERRNO = {"fsize": errno.EFBIG, "enospc": errno.ENOSPC, "erofs": errno.EROFS}
#: where each kind writes: the message must name that path
WHERE = {
    "native": "/ckpt/.B.partial",
    "universal": "/ckpt/.B.partial",
    "export": "model.safetensors",
    "convert": "/ckpt_universal/.A.partial",
}

pytestmark = pytest.mark.slow


def namespaces() -> str | None:
    """Why a private mount namespace with a tmpfs is unavailable, or ``None``."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "no unshare or mount command"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", "/mnt"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()}"


NO_NAMESPACE = namespaces()


def run_worker(work: Path, backend: str, spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **backend_env(backend, 1))
    spec = dict(spec, dim=DIM, layers=LAYERS, out=str(work / "res"))
    cmd = [sys.executable, "-m", "tests._faults_worker", json.dumps(spec)]
    if spec.get("mount"):
        cmd = ["unshare", "-m", "--propagation", "private", *cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {c["phase"]: c for c in json.loads((work / "res.rank0.json").read_text())}


def cases_for(fault: str) -> list[tuple[str, str]]:
    return [(b, fault) for b in BACKENDS]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``results(backend, fault)``: the save kinds' cases, each fault's child run once."""
    done: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}

    def get(backend: str, fault: str) -> dict[str, dict[str, Any]]:
        if (backend, fault) not in done:
            work = tmp_path_factory.mktemp(f"disk-{backend}-{fault}")
            spec: dict[str, Any] = {"fault": fault, "phases": SAVES, "dir": str(work / "d")}
            if fault != "fsize":
                spec.update(dir=str(work / "mnt"), mount=str(work / "mnt"))
            done[backend, fault] = run_worker(work, backend, spec)
        return done[backend, fault]

    return get


def check(case: dict[str, Any], kind: str, fault: str) -> None:
    assert case.get("error_type") == "ds_core.checkpoint._io.DiskWriteError", case
    assert case["errno"] == ERRNO[fault], case
    msg = case["message"]
    assert WHERE[kind] in msg, msg
    assert os.strerror(ERRNO[fault]) in msg, msg
    needed = NEEDED.get(kind)
    if needed is not None:
        assert case["needed"] == needed, case
        assert f"{needed} bytes" in msg, msg
    else:  # a conversion needs what the source's files hold
        assert case["needed"] > NEEDED["native"], case
    if kind in ("native", "universal"):
        assert "'latest' still names the previous checkpoint" in msg, msg
    assert_nothing_lost(case)


@pytest.mark.parametrize("kind", SAVES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit(results: Any, backend: str, kind: str) -> None:
    check(results(backend, "fsize")[kind], kind, "fsize")


@pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE))
@pytest.mark.parametrize("fault", ["enospc", "erofs"])
@pytest.mark.parametrize("kind", SAVES)
def test_full_and_read_only_file_systems(results: Any, fault: str, kind: str) -> None:
    check(results("cpu", fault)[kind], kind, fault)


@pytest.mark.skipif(NO_NAMESPACE is not None, reason=str(NO_NAMESPACE))
def test_nvme_swap_out_to_a_read_only_folder(tmp_path: Path) -> None:
    """The step's write-back of a sub-group fails: the error names the swap file and the
    bytes of the write; the checkpoint (saved elsewhere) is untouched."""
    mnt = tmp_path / "mnt"
    spec = {"fault": "erofs", "phases": ["nvme_swap"], "nvme": True, "stage": 2}
    spec.update(dir=str(mnt), mount=str(mnt))
    case = run_worker(tmp_path, "cpu", spec)["nvme_swap"]
    assert case.get("error_type") == "ds_core.io._engine.AsyncIOError", case
    assert case["errno"] == errno.EROFS, case
    msg = case["message"]
    assert "/swap/ds_core_swap/rank0." in msg and ".swp'" in msg, msg
    assert "write of " in msg and " bytes at offset " in msg, msg
    assert "read-only file system" in msg, msg
    assert_nothing_lost(case)
