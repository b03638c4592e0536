"""Out of memory at each engine phase: one clear error, and the previous checkpoint intact.

Issue 29 §2. Each case runs in a child process (tests/_faults_worker.py) that saves checkpoint
``A``, then makes the next allocation of size fail: on ``cpu`` an ``RLIMIT_AS`` a few MiB above
the process's address space (the host allocator raises ``RuntimeError("DefaultCPUAllocator:
can't allocate memory ...")``), on ``sim`` a ballast tensor filling the device up to a few MiB
(the device allocator raises ``torch.OutOfMemoryError``). The phase must raise
:class:`ds_core.faults.OutOfMemoryError` naming the phase, the bytes asked for, the free and
total memory and the knobs for that phase, from the allocator's error; ``latest`` must still
name ``A``, whose files are byte-identical and whose weights read back bitwise, with nothing
else left in the checkpoint folder.

The example (``examples/train_gpt.py``): an out-of-memory error in training does not save, even
with ``--save-on-interrupt`` (the state in memory is then not a completed step's, and the other
ranks are in the middle of the step's collectives): the run stops with the error and the
previous checkpoint stays the one to resume from (docs/checkpoints.md, "What a failed save
leaves").
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_core.checkpoint import inspect_checkpoint
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

ROOT = Path(__file__).resolve().parents[1]
#: cpu, and sim in its threads mode when installed (the fault is injected on both)
BACKENDS = [b for b in installed_backends() if b in ("cpu", "sim-threads")]
PHASES = ["initialize", "forward", "backward", "step"]
#: what the message must name for each phase: the knob a user would turn first
KNOBS = {
    "initialize": "offload_optimizer",
    "forward": "train_micro_batch_size_per_gpu",
    "backward": "activation checkpointing",
    "step": "offload_optimizer",
    "save": "universal=False",
}

pytestmark = pytest.mark.slow


def run_worker(work: Path, backend: str, spec: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Run the fault child; every rank's case results."""
    world = spec.get("world", 1)
    env = dict(os.environ, OMP_NUM_THREADS="1", **backend_env(backend, world))
    # glibc serves a large block freed earlier from its heap without growing the address
    # space (its mmap threshold rises with each large free): a fixed threshold maps every
    # large block afresh, so RLIMIT_AS faults the allocation the phase makes
    env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    if backend.startswith("sim"):
        env["DS_SIM_MEMORY_MB"] = "256"  # the ballast fills this, not the default 4 GiB
    spec = dict(spec, dir=str(work), out=str(work / "res"))
    proc = subprocess.run(
        [sys.executable, "-m", "tests._faults_worker", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads((work / f"res.rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=BACKENDS)
def single(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    backend = request.param
    spec = {"fault": "oom", "dim": 1024, "layers": 2, "big_rows": 8192, "phases": PHASES}
    cases = run_worker(tmp_path_factory.mktemp(f"oom-{backend}"), backend, spec)[0]
    return backend, {c["phase"]: c for c in cases}


def assert_nothing_lost(case: dict[str, Any]) -> None:
    assert case["latest"] == "A", case
    assert case["leftovers"] == [], case
    assert case["files"] >= 3 and case["hashes_equal"], case
    assert case["verified"] is True, case
    assert case["bitwise"] is True, case


def assert_shaped(case: dict[str, Any], phase: str, backend: str) -> None:
    assert case.get("error_type") == "ds_core.faults.OutOfMemoryError", case
    assert case["error_phase"] == phase
    msg = case["message"]
    assert f"out of memory in {phase} on " in msg, msg
    assert " bytes (" in msg and " MiB free of " in msg, msg
    assert KNOBS[phase] in msg, msg
    # raised from the allocator's own error, whose text it quotes
    assert case["cause"] == ("OutOfMemoryError" if backend.startswith("sim") else "RuntimeError")
    assert "Allocator: " in msg
    assert msg.count("out of memory in") == 1, msg  # one error, not one wrapped in another


@pytest.mark.parametrize("phase", PHASES)
def test_oom_names_the_phase_and_loses_nothing(single: Any, phase: str) -> None:
    backend, cases = single
    case = cases[phase]
    assert_shaped(case, phase, backend)
    assert_nothing_lost(case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_oom_in_a_two_rank_universal_save(backend: str, tmp_path: Path) -> None:
    """The save's gather buffers do not fit: the rank that failed to allocate says so, no rank
    completes the save or waits for ever, and no partial checkpoint is left."""
    spec = {"fault": "oom", "world": 2, "dim": 1024, "layers": 2, "phases": ["universal"]}
    ranks = [r[0] for r in run_worker(tmp_path, backend, spec)]
    assert all("error_type" in r for r in ranks), ranks  # nobody published B
    shaped = [r for r in ranks if r["error_type"] == "ds_core.faults.OutOfMemoryError"]
    assert shaped, ranks
    for r in shaped:
        assert r["error_phase"] == "save"
        assert "out of memory in save on " in r["message"] and KNOBS["save"] in r["message"]
    assert_nothing_lost(ranks[0])


def _tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.skipif("sim-threads" not in BACKENDS, reason="needs the sim backend")
def test_example_oom_with_save_on_interrupt_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", **backend_env("sim-threads", 2))
    env.pop("LOGLEVEL", None)
    ck = tmp_path / "ck"
    base = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--model", "tiny"]
    base += ["--seq", "64", "--no-plot", "--ranks", "2", "--out", str(tmp_path / "out")]
    first = subprocess.run(
        [*base, "--steps", "2", "--save-dir", str(ck)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    before = _tree_hashes(ck)
    # the checkpoint loads in 64 MiB; a micro-batch of 2048 sequences' activations does not
    env["DS_SIM_MEMORY_MB"] = "64"
    second = subprocess.run(
        [*base, "--steps", "4", "--resume", str(ck), "--save-dir", str(ck),
         "--save-on-interrupt", "--micro-batch", "2048"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert second.returncode == 1, second.stderr[-3000:]
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("train_gpt: error:")]
    assert len(errors) == 1, second.stderr[-3000:]
    assert "out of memory in forward on sim:" in errors[0], errors[0]
    assert "train_micro_batch_size_per_gpu" in errors[0]
    assert (ck / "latest").read_text() == "global_step2"
    assert _tree_hashes(ck) == before  # nothing written, nothing removed
    assert inspect_checkpoint(ck)["verified"] is True
