"""examples/hf_trainer.py: transformers.Trainer with a DeepSpeed config through ds_core's adapter.

Torchrun launches of two ranks: ZeRO stage 2 on CPU with ``ds_core.interop.deepspeed``
installed and on DeepSpeed's own CPU accelerator, and ZeRO stages 2 and 3 on ``sim`` through
the adapter against DeepSpeed's CPU accelerator at the same stage; the losses the Trainer logs
must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rankpool import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path, accelerator: str, stage: int, backend: str = "cpu") -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    env.update(DS_ACCELERATOR=backend, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if backend == "sim":
        env["DS_SIM_DEVICES"] = "2"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(ROOT / "examples" / "hf_trainer.py"),
        "--accelerator",
        accelerator,
        "--stage",
        str(stage),
        "--out",
        str(out),
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "File " in line]
    assert proc.returncode == 0, "\n".join(errors[-40:]) or proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


_REFERENCE: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def deepspeed_cpu(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The example on DeepSpeed's own CPU accelerator at a stage, run once per module."""

    def run(stage: int) -> list[dict[str, Any]]:
        if stage not in _REFERENCE:
            out = tmp_path_factory.mktemp(f"deepspeed-stage{stage}")
            _REFERENCE[stage] = _train(out, "deepspeed", stage)
        return _REFERENCE[stage]

    return run


@pytest.mark.slow
def test_hf_trainer_zero2_through_the_adapter_matches_deepspeeds_cpu_accelerator(
    tmp_path: Path, deepspeed_cpu: Any
) -> None:
    ours = _train(tmp_path / "adapter", "ds_core", 2)
    theirs = deepspeed_cpu(2)
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine["accelerator"] == "DeepSpeedAdapter"
        assert reference["accelerator"] == "CPU_Accelerator"
        assert len(mine["losses"]) == len(reference["losses"]) == 3
        torch.testing.assert_close(
            torch.tensor(mine["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-6
        )


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_on_sim_matches_deepspeeds_cpu_accelerator(
    tmp_path: Path, stage: int, deepspeed_cpu: Any
) -> None:
    pytest.importorskip("ds_backend_sim")
    ours = _train(tmp_path / "sim", "ds_core", stage, backend="sim")
    theirs = deepspeed_cpu(stage)
    for rank, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["device"] == f"sim:{rank}"
        assert reference["accelerator"] == "CPU_Accelerator"
        assert len(mine["losses"]) == len(reference["losses"]) == 3
        torch.testing.assert_close(
            torch.tensor(mine["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5
        )
