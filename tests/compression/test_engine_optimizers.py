"""DeepSpeed's Lamb and communication-compressing optimizers driven by the ZeRO engine at
stage 0 (built from the config) equal the same optimizer driven by hand on each rank's replica
with the gradients the optimizer asks for; checkpoints resume them bit for bit (their
error-feedback buffers are saved per rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.compression._engine_jobs import MICRO
from tests.compression.conftest import RunJob

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Lamb": {"lr": 1e-2, "weight_decay": 0.01, "max_coeff": 0.5},
    "OneBitAdam": {"lr": 1e-2, "freeze_step": 3},
    "ZeroOneAdam": {
        "lr": 1e-2,
        "var_freeze_step": 4,
        "var_update_scaler": 1,
        "local_step_clipper": 2,
    },
    "OneBitLamb": {"lr": 1e-2, "freeze_step": 3, "weight_decay": 0.01},
}
STEPS = 8


def config(name: str, gas: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": name, "params": OPTIMIZERS[name]},
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "gas"), [(n, 1) for n in OPTIMIZERS] + [("OneBitAdam", 2), ("ZeroOneAdam", 3)]
)
def test_engine_drives_the_optimizer_as_by_hand(run_ranks: RunJob, name: str, gas: int) -> None:
    # accumulation: the local gradients of the window's micro-batches sum on each rank
    engine = run_ranks(2, "tests.compression._engine_jobs:train", config(name, gas), STEPS)
    by_hand = run_ranks(2, "tests.compression._engine_jobs:manual", config(name, gas), STEPS)
    for r in range(2):
        assert engine[r]["flags"] == by_hand[r]["flags"]
        for step in range(STEPS):
            for key, value in by_hand[r]["params"][step].items():
                # the same fp32 operations in the same order: equal to rounding of the
                # averaging (sum then scale) at most
                torch.testing.assert_close(
                    engine[r]["params"][step][key], value, rtol=1e-6, atol=1e-7
                )
    if name != "Lamb":  # the compressing optimizers switched to local gradients
        assert engine[0]["flags"][0] and not all(engine[0]["flags"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "Lamb"])
def test_checkpoint_resumes_bit_for_bit(run_ranks: RunJob, tmp_path: Any, name: str) -> None:
    ckpt = str(tmp_path / "ckpt")
    straight = run_ranks(2, "tests.compression._engine_jobs:train", config(name), STEPS, 5, ckpt)
    resumed = run_ranks(
        2,
        "tests.compression._engine_jobs:train",
        {**config(name), "_load": True},
        STEPS - 5,
        None,
        ckpt,
    )
    for r in range(2):
        assert resumed[r]["flags"] == straight[r]["flags"][5:]
        for step in range(STEPS - 5):
            for key, value in straight[r]["params"][5 + step].items():
                assert torch.equal(resumed[r]["params"][step][key], value), (r, step, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(run_ranks: RunJob, name: str) -> None:
    # fp16 with local gradients: rank 1 overflows at step 5 (compressing by then); the engine
    # agrees on the skip across ranks (else the optimizer's collectives would not match), so
    # both ranks skip the same step and their replicas stay equal.
    cfg = {**config(name), "fp16": {"enabled": True, "initial_scale_power": 8}}
    got = run_ranks(2, "tests.compression._engine_jobs:train", cfg, STEPS, None, "", (1, 5))
    assert not got[0]["flags"][5] and not got[1]["flags"][5]
    assert got[0]["skipped"] == got[1]["skipped"] >= 1
    for key, value in got[0]["params"][-1].items():
        assert torch.equal(got[1]["params"][-1][key], value), key
    before, after = got[0]["params"][4], got[0]["params"][5]
    assert all(torch.equal(before[k], after[k]) for k in before)  # step 5 applied nothing
