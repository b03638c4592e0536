"""The bad-input corpus (issue 16): every bad input gets one clear error and loses nothing.

Each case asserts the outcome (the exception type, or the exit status and that no traceback is
printed for a user mistake) and the message's key words. In-process where possible; the engine
API cases run in one worker process (tests/_bad_api_worker.py, one rank), and only the CLI and
example cases that must exit run as subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

# ---------------------------------------------------------------------------------------------
# engine API misuse (one worker process, one rank)


@pytest.fixture(scope="module")
def api() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests._bad_api_worker"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


#: case -> (expected "Type: message" prefix, key words in the message)
API_ERRORS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{
        f"second_initialize_s{s}": (
            "ConfigError: initialize(model=...): this model already belongs to engine #",
            (
                f"ZeRO stage {s}",
                "_bad_api_worker.py:",
                "still live",
                "first engine losses fell: True",
            ),
        )
        for s in (0, 1, 2, 3)
    },
    "model_none": ("ConfigError: initialize(model=None)", ("torch.nn.Module",)),
    "model_callable": ("ConfigError: initialize(model=...)", ("got function", "wrap a function")),
    "model_string": ("ConfigError: initialize(model=...)", ("torch.nn.Module, got str",)),
    "model_frozen": ("ConfigError: initialize(model=...)", ("all 4 parameters", "frozen")),
    "model_no_params": ("ConfigError: initialize(model=...)", ("no parameters",)),
    **{
        f"destroyed_{call}": (
            f"EngineDestroyedError: {name}(): engine #",
            ("was destroyed", "build a new model"),
        )
        for call, name in (
            ("forward", "forward"),
            ("backward", "backward"),
            ("step", "step"),
            ("save_checkpoint", "save_checkpoint"),
            ("load_checkpoint", "load_checkpoint"),
            ("state_dict", "module_state_dict"),
        )
    },
    "destroyed_initialize_again": (
        "ConfigError: initialize(model=...): this model's parameters were emptied when engine #",
        ("was destroyed", "fresh model"),
    ),
    "loss_vector": ("ValueError: backward(loss): loss must be a scalar", ("(4, 1)", "mean()")),
    "loss_float": ("TypeError: backward(loss): loss must be a torch.Tensor", ("got float",)),
    "loss_detached": ("ValueError: backward(loss): loss does not require grad", ("detached",)),
    "loss_no_grad": ("ValueError: backward(loss): loss does not require grad", ("no_grad",)),
    "loss_other_model": ("RuntimeError: backward(loss): the loss reached none", ("forward",)),
    **{
        f"step_{kind}_s{s}": (
            "RuntimeError: step(): no engine.backward(loss) since the last update",
            ("call backward before each step",),
        )
        for kind in ("without_backward", "twice")
        for s in (0, 2)
    },
}

#: misuse-looking inputs that are fine: case -> the outcome
API_ACCEPTED = {
    "model_frozen_forward_only": "ok: (4, 1)",  # a forward-only engine needs no trainable params
    "one_element_loss_shape_1": "ok: backward ran",  # shape (1,) is a scalar to autograd
}


@pytest.mark.parametrize("case", sorted(API_ERRORS))
def test_api_misuse_is_one_clear_error(api: dict[str, Any], case: str) -> None:
    prefix, words = API_ERRORS[case]
    got = api[case]
    assert got.startswith(prefix), got
    for word in words:
        assert word in got, (word, got)


@pytest.mark.parametrize("case", sorted(API_ACCEPTED))
def test_api_input_accepted_correctly(api: dict[str, Any], case: str) -> None:
    assert api[case] == API_ACCEPTED[case]


def test_nan_loss_in_fp32_is_skipped_and_reported(api: dict[str, Any]) -> None:
    res = api["nan_loss_fp32"]
    assert res["skipped"] == 1 and res["finite"], res
    assert "step 3 skipped: non-finite gradient (inf or NaN)" in res["log"], res["log"]
    step4 = [line for line in res["log"] if line.startswith("step=4 ")]
    assert step4 and "skipped=1" in step4[0], res["log"]
