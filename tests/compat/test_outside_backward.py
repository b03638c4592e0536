"""Gradients made outside ``engine.backward`` (issue 26 §3), against DeepSpeed 0.19.8 itself.

``tests/compat/_outside_backward.py`` runs each program at ZeRO stages 0-3 on two ranks,
once with real DeepSpeed (its CPU accelerator, gloo) and once with ds_core per backend of
:data:`tests.compat.conftest.COMPAT_BACKENDS` (cpu, and sim in lazy mode: the data drawn on the
host and moved to the engine's device); DeepSpeed runs once, on cpu, in parallel with the first
ds_core run, each spawning its ranks once. DeepSpeed runs on sim only through the interop
adapter, where a module must be built on the device before ``initialize``
(docs/interop.md, "Known differences"), which these programs, transcribing the examples, do
not do; its cpu results are the reference for both ds_core runs. Every ds_core result is
compared with a DeepSpeed result within 1e-6 (losses and final parameters): the same stage where ds_core does what
DeepSpeed does, another stage of the same program where ds_core deliberately differs (the
reason is in ``EXPECT``, and docs/from-deepspeed.md "Gradients made outside engine.backward"
has the table). Where both refuse a pattern, both must raise; where ds_core refuses alone, its
message is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.compat.conftest import COMPAT_BACKENDS
from tests.zero._common import backend_env

pytest.importorskip("deepspeed", reason="real DeepSpeed is needed to compare against")
pytestmark = pytest.mark.slow  # two spawned worker pairs (about 80 s on 2 busy cores)

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6

# DeepSpeed 0.19.8 at stages 1-2 keeps only the last engine.backward's gradients of an
# accumulation boundary (stage_1_and_2.py independent_gradient_partition_epilogue assigns
# averaged_gradients at the boundary): with gradient_accumulation_steps 1, the discriminator's
# errD_real backward is dropped. ds_core accumulates every backward, as plain PyTorch and
# DeepSpeed at stages 0 and 3 do.
LAST_WINS = "DeepSpeed stage 1-2 keeps only the boundary's last backward"
# Raw-module forwards (netD(fake)) reach a ZeRO-2/3 discriminator's gradient hooks in the
# generator's backward; DeepSpeed's next discriminator backward then fails an internal
# assertion (stage 2 "already been reduced", stage 3 a bare assert), and its stage-3
# optimizer.zero_grad() raises "unknown parameter type" on CPU. ds_core runs the example as
# plain PyTorch does (tests/compat/test_loops.py), which is DeepSpeed's stage-0 result.
DS_CRASH = "DeepSpeed fails inside its ZeRO-2/3 hooks"
# DeepSpeed refuses a plain backward through a stage-0 engine's outputs ("Direct calls to
# tensor.backward() are not supported", engine.py _backward_prologue); ds_core takes it as at
# stages 1-3 (documented under "PyTorch-style backward").
STAGE0_PLAIN = "ds_core accepts a plain backward at stage 0"
# A backward the engine's forward never saw (raw module forward, plain loss.backward()):
# DeepSpeed at stage 0 steps on this rank's unreduced gradients (the ranks drift apart); at
# stages 1-3 its step fails with KeyError (no averaged gradients). ds_core's step refuses at
# every stage, naming the fix.
STRAY = "the parameters hold gradients no engine.backward() produced"

#: (program, stage) -> what to check; default "same" (equal to DeepSpeed at that stage).
#: ("like", stage, why): ds_core equals DeepSpeed's result at ``stage``;
#: ("refused", text, why): ds_core raises with ``text`` (DeepSpeed's outcome recorded only);
#: ("both_refuse",): both raise.
EXPECT: dict[tuple[str, int], tuple[Any, ...]] = {}
for _name in ("gan_example", "gan_optimizer_zero", "gan_engine_zero"):
    EXPECT[(_name, 1)] = ("like", 0, LAST_WINS)
    EXPECT[(_name, 2)] = EXPECT[(_name, 3)] = ("like", 0, DS_CRASH)
# A discriminator that never zeroes: the generator's stray gradients reach its next step.
EXPECT[("gan_no_zero", 1)] = ("like", 0, LAST_WINS)
EXPECT[("gan_no_zero", 2)] = EXPECT[("gan_no_zero", 3)] = ("like", 0, DS_CRASH)
for _name in ("gan_engines", "gan_engines_plain"):
    EXPECT[(_name, 0)] = ("like", 3, STAGE0_PLAIN)
    EXPECT[(_name, 1)] = EXPECT[(_name, 2)] = ("like", 3, LAST_WINS)
for _name in ("single_plain", "single_plain_gas2", "single_plain_config_opt"):
    EXPECT[(_name, 0)] = ("like", 1, STAGE0_PLAIN)
EXPECT[("single_two_backwards", 1)] = EXPECT[("single_two_backwards", 2)] = (
    "like",
    0,
    LAST_WINS,
)
for _name in ("gan_plain", "single_module_plain"):
    EXPECT[(_name, 0)] = ("refused", STRAY, "DeepSpeed steps on unreduced gradients")
    for _stage in (1, 2, 3):
        EXPECT[(_name, _stage)] = ("both_refuse",)


def _run(impl: str, out: Path, backend: str = "cpu") -> subprocess.Popen[str]:
    env = dict(os.environ, **backend_env(backend, 2), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.compat._outside_backward", impl, str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


#: DeepSpeed's results (on cpu), run once per test session: the reference of every backend.
_DEEPSPEED: dict[str, Any] = {}


def _collect(proc: subprocess.Popen[str], out: Path, what: str) -> dict[str, Any]:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{what} worker failed:\n{err[-6000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module", params=COMPAT_BACKENDS)
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """``{"deepspeed": ..., "ds_core": ...}``, each ``{program: {stage: result}}``; ds_core's
    on the parametrised backend."""
    backend = str(request.param)
    tmp = tmp_path_factory.mktemp(f"outside_backward-{backend}")
    ds_proc = None if _DEEPSPEED else _run("deepspeed", tmp / "deepspeed.json")
    ours = _run("ds_core", tmp / "ds_core.json", backend)
    if ds_proc is not None:
        _DEEPSPEED.update(_collect(ds_proc, tmp / "deepspeed.json", "deepspeed"))
    return {
        "deepspeed": _DEEPSPEED,
        "ds_core": _collect(ours, tmp / "ds_core.json", f"ds_core on {backend}"),
    }


def _close(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert "error" not in theirs, f"{what}: DeepSpeed raised {theirs}"
    assert "error" not in ours, f"{what}: ds_core raised {ours}"
    assert len(ours["losses"]) == len(theirs["losses"]), what
    worst = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
    assert worst <= TOL, f"{what}: losses differ by {worst}: {ours['losses']} vs {theirs['losses']}"
    for i, (p, q) in enumerate(zip(ours["params"], theirs["params"], strict=True)):
        worst = max(abs(a - b) for a, b in zip(p, q, strict=True))
        assert worst <= TOL, f"{what}: parameter {i} differs by {worst}"


def test_every_program_ran_at_every_stage(results: dict[str, dict[str, Any]]) -> None:
    from tests.compat._outside_backward import PROGRAMS, STAGES

    for impl in ("deepspeed", "ds_core"):
        assert set(results[impl]) == set(PROGRAMS), impl
        for name in PROGRAMS:
            assert set(results[impl][name]) == {str(s) for s in STAGES}, (impl, name)


def test_ds_core_matches_deepspeed(results: dict[str, dict[str, Any]]) -> None:
    """One test over every (program, stage), so one worker pair serves them all; every
    mismatch is collected before failing."""
    ds, ours = results["deepspeed"], results["ds_core"]
    failures = []
    for name, by_stage in ours.items():
        for stage_s, mine in by_stage.items():
            stage = int(stage_s)
            expect = EXPECT.get((name, stage), ("same",))
            what = f"{name} stage {stage} ({expect[-1] if len(expect) > 1 else expect[0]})"
            try:
                if expect[0] == "same":
                    _close(mine, ds[name][stage_s], what)
                elif expect[0] == "like":
                    _close(mine, ds[name][str(expect[1])], what)
                elif expect[0] == "refused":
                    assert "error" in mine and expect[1] in mine["message"], (what, mine)
                else:
                    assert "error" in mine and "error" in ds[name][stage_s], (what, mine)
            except AssertionError as exc:
                failures.append(str(exc))
    assert not failures, "\n".join(failures)


def test_deepspeed_outcomes_this_file_assumes(results: dict[str, dict[str, Any]]) -> None:
    """The DeepSpeed side of ``EXPECT``: where it says DeepSpeed refuses or drops gradients,
    DeepSpeed does (a newer DeepSpeed that fixes one of these fails here, naming it)."""
    ds = results["deepspeed"]
    for (name, stage), expect in EXPECT.items():
        theirs = ds[name][str(stage)]
        why = expect[-1]
        if why in (DS_CRASH, STAGE0_PLAIN) or expect[0] == "both_refuse":
            assert "error" in theirs, (name, stage, why)
        if why == STAGE0_PLAIN:
            assert "Direct calls to tensor.backward()" in theirs["message"], (name, stage)
        if why == LAST_WINS:
            like = ds[name][str(expect[1])]
            assert "error" not in theirs and theirs["losses"] != like["losses"], (name, stage)
        if expect[0] == "refused":
            assert "error" not in theirs, (name, stage)
