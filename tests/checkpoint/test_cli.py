"""``ds-core checkpoint convert | export | inspect`` on the exact-resume suite's checkpoints,
saved on every backend of ``CHECKPOINT_BACKENDS`` (``backend`` fixture,
tests/checkpoint/conftest.py): the offline tools read a checkpoint written from a device's
memory as one written from the host's (the exact-resume suite's saves, run once per test
process: no training of its own when test_resume ran in the same process)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ds_core.checkpoint import CheckpointReader, consolidated_state_dict
from ds_core.cli import main
from tests.zero._common import TinyNet

pytestmark = pytest.mark.slow


@pytest.fixture
def native(suite: Any, backend: str) -> Path:
    root: Path = suite("resume_save", backend).ckroot / "s3" / "native"
    return root


def test_inspect(native: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "inspect", str(native)]) == 0
    out = capsys.readouterr().out
    for line in (
        "tag: global_step3",
        "format: native",
        "zero stage: 3",
        "world size: 2",
        "global steps: 3",
        "manifest: verified",
    ):
        assert line in out, out
    params = sum(p.numel() for p in TinyNet(1).parameters())
    assert f"parameters: {params:,} in " in out


def test_inspect_fails_on_a_corrupted_copy(
    native: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "c"
    shutil.copytree(native, copy)
    (copy / "global_step3" / "rank_00000.pt").write_bytes(b"junk")
    assert main(["checkpoint", "inspect", str(copy)]) == 1
    assert "manifest: FAILED: " in capsys.readouterr().out


def test_convert_then_load_equal(
    native: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoint", "convert", str(native), str(tmp_path / "u")]) == 0
    reader = CheckpointReader(tmp_path / "u" / "global_step3")
    assert reader.format == "universal"
    a, b = consolidated_state_dict(native), consolidated_state_dict(tmp_path / "u")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # every optimizer moment is the fragments joined, unpadded
    for key in reader.keys():
        if "fp32" in reader.entry(key):
            assert reader.entry(key)["state"]["exp_avg"].shape == reader.entry(key)["fp32"].shape
    capsys.readouterr()
    assert main(["checkpoint", "convert", str(tmp_path / "u"), str(tmp_path / "v")]) == 2
    assert "already in the universal format" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "dtype"), [("m.safetensors", "fp32"), ("m.safetensors", "bf16"), ("m.pt", "fp32")]
)
def test_export_loads_into_a_plain_module(
    native: Path, tmp_path: Path, name: str, dtype: str
) -> None:
    out = tmp_path / name
    assert main(["checkpoint", "export", str(native), str(out), "--dtype", dtype]) == 0
    state = load_file(out) if name.endswith(".safetensors") else torch.load(out, weights_only=True)
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert all(v.dtype == want for v in state.values())
    model = TinyNet(1).to(want)
    model.load_state_dict(state)  # strict: every parameter, the tied one and buffers
    ref = consolidated_state_dict(native)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k].to(want)), k
