"""A checkpoint saved on ``sim:1`` resumes on ``sim:0``, bit for bit.

On the CPU backend every rank's device is the host, so a checkpoint that recorded a device
index, or restored the RNG state of the wrong device, would load anyway. Here one process
trains on ``sim:1`` (``LOCAL_RANK=1``) with dropout drawing from the device's generator,
saves, and trains on; a second process on ``sim:0`` loads the checkpoint and must take exactly
the same steps: same losses, same parameters, parameters on ``sim:0``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.rankpool import free_port

pytest.importorskip("ds_backend_sim")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import ds_core
    mode, folder = sys.argv[1], sys.argv[2]
    ds_core.init_distributed()
    acc = ds_core.get_accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
           "zero_optimization": {"stage": 2}}
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=data) for _ in range(6)]
    def train(xs):
        out = []
        for x in xs:
            loss = engine(x.to(engine.device)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out
    if mode == "save":
        train(batches[:3])
        engine.save_checkpoint(folder)
    else:
        engine.load_checkpoint(folder)
    losses = train(batches[3:])
    state = {k: v.cpu().tolist() for k, v in engine.gathered_state_dict().items()}
    devices = sorted({str(p.device) for p in model.parameters()})
    print("RESULT " + json.dumps({"losses": losses, "state": state, "devices": devices,
                                  "device": str(engine.device)}), flush=True)
    engine.destroy()
    ds_core.destroy_distributed()
    """
)


def run(mode: str, folder: Path, local_rank: int) -> dict[str, object]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    env.update(
        DS_ACCELERATOR="sim", DS_SIM_ASYNC="lazy", RANK="0", WORLD_SIZE="1",
        LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(folder)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    return result


def test_a_checkpoint_saved_on_sim_1_resumes_on_sim_0_bit_for_bit(tmp_path: Path) -> None:
    saved = run("save", tmp_path / "ck", local_rank=1)
    loaded = run("load", tmp_path / "ck", local_rank=0)
    assert saved["device"] == "sim:1" and loaded["device"] == "sim:0"
    assert loaded["devices"] == ["sim:0"]
    assert loaded["losses"] == saved["losses"]  # exact: dropout draws the saved device RNG
    assert loaded["state"] == saved["state"]
