"""The newcomer's path: save the GPT example on 2 ranks, resume on 1, export, load in torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds_core.checkpoint import consolidated_state_dict
from ds_core.cli import main
from examples.gpt import GPT, PRESETS
from tests.checkpoint.conftest import ROOT


def example(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--model", "tiny", "--seq", "32",
        "--micro-batch", "4", "--no-plot", "--out", str(tmp_path / "out"), *args,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_save_on_2_resume_on_1_export_and_load(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = example(tmp_path, "--ranks", "2", "--stage", "3", "--steps", "3", "--save-dir", str(ck))
    assert first.returncode == 0, first.stderr[-4000:]
    assert (ck / "latest").read_text() == "global_step3"
    second = example(
        tmp_path, "--ranks", "1", "--stage", "0", "--steps", "5", "--resume", str(ck),
        "--save-dir", str(ck),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"resumed from {ck / 'global_step3'} at step 3" in second.stderr
    assert (ck / "latest").read_text() == "global_step5"
    out = tmp_path / "gpt.safetensors"
    assert main(["checkpoint", "export", str(ck), str(out)]) == 0
    model = GPT(PRESETS["tiny"])
    model.load_state_dict(load_file(out))  # strict: a plain nn.Module takes the export as is
    ref = consolidated_state_dict(ck)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
