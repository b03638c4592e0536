"""Checkpoints of NVMe-resident optimizer state (see [Note: NVMe state in checkpoints]).

Bitwise at stages 1-3 on 2 ranks, both formats: what a load puts in the swap files (read back
through the swap engine) equals what was saved; resuming on NVMe or on host offload continues
exactly as the uninterrupted NVMe run (host offload is the same kernel on the same bytes); a
load without offload holds the same state; a host-offload checkpoint resumes onto NVMe as the
uninterrupted host-offload run, and one saved without offload (torch's AdamW, its step a
tensor) loads onto NVMe holding the saved state. The NVMe checkpoint holds the same values as the host-offload
one, and no swap file is in it. A rank SIGKILLed mid-swap or mid-save leaves the previous
checkpoint loadable, bit for bit.

The save/load cases run on every backend of ``CHECKPOINT_BACKENDS`` (``backend`` fixture,
tests/checkpoint/conftest.py): on sim the swap buffers sit between the device's parameters and
the files. The kill case stays on cpu: what it tests is the file system's state after a
SIGKILL, which no device changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_core.checkpoint import CheckpointReader, inspect_checkpoint
from tests.checkpoint._nvme import FORMATS, LOADS, STAGES
from tests.checkpoint.conftest import ROOT, worker_env
from tests.checkpoint.test_resume import equal

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("label", list(LOADS))
@pytest.mark.parametrize("stage", STAGES)
def test_nvme_state_resumes_exactly(
    suite: Any, backend: str, stage: int, label: str, fmt: str
) -> None:
    target, source = LOADS[label]
    ref = suite("nvme_save", backend).ranks(f"save_{source}_s{stage}")
    got = suite("nvme_load", backend).ranks(f"{label}_s{stage}_{fmt}")
    for r, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert b["path"].endswith("global_step3"), b["path"]
        equal(a["at_save"], b["loaded"], f"rank{r}.loaded")
        if "none" in (target, source):  # torch's AdamW on one side: other arithmetic
            continue
        for key in ("losses", "counters", "lr", "state", "params", "rng"):
            equal(a[key], b[key], f"rank{r}.{key}")


@pytest.mark.parametrize("stage", STAGES)
def test_nvme_checkpoint_holds_what_host_offload_holds(
    suite: Any, backend: str, stage: int
) -> None:
    res = suite("nvme_save", backend)
    nvme, cpu = res.ranks(f"save_nvme_s{stage}"), res.ranks(f"save_cpu_s{stage}")
    for a, b in zip(nvme, cpu, strict=True):
        equal(a["at_save"], b["at_save"])  # the same training on both sides
    for fmt in FORMATS:
        ours = CheckpointReader(res.ckroot / f"nvme_s{stage}" / fmt / "global_step3")
        theirs = CheckpointReader(res.ckroot / f"cpu_s{stage}" / fmt / "global_step3")
        assert list(ours.keys()) == list(theirs.keys())
        for key in ours.keys():
            equal(ours.entry(key), theirs.entry(key), f"{fmt}.{key}")
        names = set(ours.manifest["files"])
        assert not any(n.endswith(".swp") for n in names)
        if fmt == "native":  # one file per rank and sub-group, read through the swap engine
            assert any(n.startswith("nvme/rank_00001.sg") for n in names), sorted(names)
    assert nvme[0]["swap_files"], "the run swapped nothing"


def test_kill_mid_swap_and_mid_save_leave_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint._nvme_kill", str(tmp_path)],
        cwd=ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ended = json.loads((tmp_path / "ended.json").read_text())
    assert ended == {"save_a": "completed", "swap": "killed", "save": "killed", "load": "completed"}
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "A" and not (ckpt / "B").exists()
    assert inspect_checkpoint(ckpt, tag="A")["verified"] is True
    for r in range(2):
        saved = torch.load(tmp_path / f"saved.rank{r}.pt", weights_only=False)
        loaded = torch.load(tmp_path / f"loaded.rank{r}.pt", weights_only=False)
        equal(saved, loaded, f"rank{r}")
