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
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_core.checkpoint import inspect_checkpoint
from ds_core.faults import OutOfMemoryError, boundary, is_oom
from ds_core.zero import torch_backward
from ds_core.zero.torch_backward import shape_torch_backward_faults
from tests._faults_worker import assert_nothing_lost
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

ROOT = Path(__file__).resolve().parents[1]
#: cpu, and sim in its threads mode when installed (the fault is injected on both)
BACKENDS = [b for b in installed_backends() if b in ("cpu", "sim-threads")]
PHASES = ["initialize", "forward", "backward", "step"]
#: ``loss.backward()`` cases (tests/_faults_worker.py): the allocation fails before the
#: engine's backward begins (in the loss's nodes), or inside it
TORCH_STYLE = ["torch_backward", "torch_backward_in_engine"]
#: what the message must name for each phase: the knob a user would turn first
KNOBS = {
    "initialize": "offload_optimizer",
    "forward": "train_micro_batch_size_per_gpu",
    "backward": "activation checkpointing",
    "step": "offload_optimizer",
    "save": "universal=False",
}


# -- the classification and the boundary, in process (fast) --------------------------------


@pytest.mark.parametrize(
    ("exc", "oom"),
    [
        (torch.OutOfMemoryError("sim:0 out of memory: tried to allocate 4096 bytes"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
        (MemoryError(), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("out of memory"), False),  # not an allocator's error type
    ],
)  # fmt: skip
def test_allocator_failures_are_recognised(exc: BaseException, oom: bool) -> None:
    assert is_oom(exc) is oom


class _Engine:
    label = "engine #0 (test)"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    @boundary("backward")
    def backward(self) -> None:
        raise self.exc


def test_the_boundary_shapes_an_oom_and_passes_the_rest_through() -> None:
    original = RuntimeError(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes"
    )
    with pytest.raises(OutOfMemoryError) as info:
        _Engine(original).backward()
    err = info.value
    assert err.__cause__ is original and err.phase == "backward" and err.requested == 4096
    assert str(err).startswith("engine #0 (test): out of memory in backward on ")
    assert "allocating 4096 bytes (0.0 MiB)" in str(err) and "reduce_bucket_size" in str(err)
    assert err.free is not None and err.total is not None and err.free <= err.total
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError) as passed:
        _Engine(other).backward()
    assert passed.value is other
    with pytest.raises(OutOfMemoryError) as again:  # already shaped: not wrapped twice
        _Engine(err).backward()
    assert again.value is err
    with pytest.raises(ValueError, match="phase 'fwd'"):
        boundary("fwd")


class _Fails(torch.autograd.Function):
    """Identity whose backward raises ``error`` (the host allocator's, or another)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, error: BaseException) -> torch.Tensor:
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise ctx.error


class _Outputs:
    """What the wrapper reads of an engine: its label, the outputs its forward hooked."""

    label = "engine #0 (test)"
    _backward_kind = None

    def __init__(self, *outs: torch.Tensor) -> None:
        self._hooked = [weakref.ref(t) for t in outs]


def test_loss_backward_is_shaped_only_through_an_engines_outputs() -> None:
    """[Note: faults in a PyTorch-style backward]: torch.autograd.backward, wrapped, shapes
    an allocator failure in a graph that reaches an engine's hooked outputs, and passes every
    other error, and every other graph's, through as torch raised it."""
    shape_torch_backward_faults()
    shape_torch_backward_faults()  # idempotent: wrapped once
    assert getattr(torch.autograd.backward, "__wrapped__", None) is not None
    assert not hasattr(torch.autograd.backward.__wrapped__, "_ds_core_shaped")
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 bytes")
    x = torch.randn(4, requires_grad=True)
    out = x * 2  # "the engine's output"
    engine = _Outputs(out)
    torch_backward._hooking.add(engine)  # type: ignore[arg-type]
    try:
        with pytest.raises(OutOfMemoryError) as info:
            _Fails.apply(out, oom).pow(2).sum().backward()  # fails in the loss's nodes
        assert info.value.__cause__ is oom and info.value.phase == "backward"
        assert str(info.value).startswith("engine #0 (test): out of memory in backward on ")
        other = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        with pytest.raises(RuntimeError) as passed:
            _Fails.apply(x * 2, other).sum().backward()
        assert passed.value is other
        elsewhere = torch.randn(4, requires_grad=True)  # a graph without the engine's outputs
        with pytest.raises(RuntimeError) as unrelated:
            _Fails.apply(elsewhere * 3, oom).sum().backward()
        assert unrelated.value is oom
    finally:
        torch_backward._hooking.discard(engine)  # type: ignore[arg-type]


# -- child processes with the fault injected -------------------------------------------------


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
    phases = [*PHASES, *TORCH_STYLE]
    spec = {"fault": "oom", "dim": 1024, "layers": 2, "big_rows": 8192, "phases": phases}
    cases = run_worker(tmp_path_factory.mktemp(f"oom-{backend}"), backend, spec)[0]
    return backend, {c["phase"]: c for c in cases}


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


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_oom_names_the_phase_and_loses_nothing(single: Any, phase: str) -> None:
    backend, cases = single
    case = cases[phase]
    assert_shaped(case, phase, backend)
    assert_nothing_lost(case)


@pytest.mark.slow
@pytest.mark.parametrize("case_name", TORCH_STYLE)
def test_oom_in_a_pytorch_style_backward_is_shaped_too(single: Any, case_name: str) -> None:
    """``loss.backward()`` in place of ``engine.backward(loss)`` ([Note: faults in a
    PyTorch-style backward] in ds_core/zero/torch_backward.py), failing in the loss's nodes
    or in the engine's: the same error, the same checkpoint guarantees, and after
    ``zero_grad()`` the engine trains on."""
    backend, cases = single
    case = cases[case_name]
    assert_shaped(case, "backward", backend)
    assert_nothing_lost(case)
    assert case["trained_after"] is True, case


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_oom_in_a_pipeline_stage_backward(backend: str, tmp_path: Path) -> None:
    """A non-last pipeline stage back-propagates the received gradient through its outputs
    (not ``engine.backward``): its out-of-memory error is shaped as the last stage's is; the
    other stage ends with an error of its own instead of waiting for ever."""
    spec = {"fault": "oom", "world": 2, "dim": 1024, "big_rows": 2048, "pipeline": True}
    first, last = (r[0] for r in run_worker(tmp_path, backend, spec))
    assert (first["stage"], last["stage"]) == (0, 1)
    assert_shaped(first, "backward", backend)
    assert "PipelineEngine" in first["trace"] or "_exec_backward" in first["trace"], first
    assert "error_type" in last and last["error_type"] != "ds_core.faults.OutOfMemoryError", last


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif("sim-threads" not in BACKENDS, reason="needs the sim backend")
def test_example_oom_with_save_on_interrupt_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", **backend_env("sim-threads", 2))
    # the example launches its ranks only when it is not one itself: launcher variables that
    # an earlier in-process test left in this process's environment must not reach it
    for name in ("LOGLEVEL", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
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
