"""1-bit Adam (ds_core.optim.onebit_adam) in the engine at stage 0, on real ranks of each
backend, against a single-process reference written here from DeepSpeed's update
(``deepspeed/runtime/fp16/onebit/adam.py``): set-up step, warm-up on averaged gradients,
then local momenta averaged by the compressed all-reduce with error feedback."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ds_core import ConfigError
from ds_core.comm.compressed import padded_numel
from ds_core.optim.onebit_adam import OneBitAdam
from ds_core.zero.config import load_config
from tests.compression._engine_jobs import MICRO, batch, model
from tests.compression.conftest import RunJob

LR, FREEZE, WD = 1e-2, 4, 0.01


def config(freeze: int = FREEZE, **extra: Any) -> dict[str, Any]:
    params = {"lr": LR, "freeze_step": freeze, "weight_decay": WD}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "OneBitAdam", "params": params},
        **extra,
    }


class Compressor:
    """All ranks' compressed all-reduce of one tensor, with their error buffers (float64)."""

    def __init__(self, numel: int, world: int) -> None:
        self.numel, self.world = numel, world
        self.padded = padded_numel(numel, world)
        self.worker = [np.zeros(self.padded) for _ in range(world)]
        self.server = [np.zeros(self.padded // world) for _ in range(world)]

    @staticmethod
    def _compress(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scale = np.linalg.norm(x) / np.sqrt(x.size)
        sign = np.where(x >= 0, 1.0, -1.0)
        return scale * sign, x - scale * sign

    def mean(self, per_rank: list[np.ndarray]) -> np.ndarray:
        chunk = self.padded // self.world
        sent = []
        for r, x in enumerate(per_rank):
            full = np.zeros(self.padded)
            full[: self.numel] = x.reshape(-1)
            approx, self.worker[r] = self._compress(full + self.worker[r])
            sent.append(approx)
        out = np.zeros(self.padded)
        for r in range(self.world):
            part = slice(r * chunk, (r + 1) * chunk)
            approx, self.server[r] = self._compress(
                sum(s[part] for s in sent) / self.world + self.server[r]
            )
            out[part] = approx
        return out[: self.numel].reshape(per_rank[0].shape)


def reference(
    world: int, steps: int, freeze: int = FREEZE
) -> tuple[list[dict[str, np.ndarray]], list[bool]]:
    """DeepSpeed's 1-bit Adam on ``world`` simulated ranks, in float64."""
    net = model().double()
    params = dict(net.named_parameters())
    m = {n: np.zeros(tuple(p.shape)) for n, p in params.items()}
    v = {n: np.zeros(tuple(p.shape)) for n, p in params.items()}
    comp = {n: Compressor(p.numel(), world) for n, p in params.items()}
    b1, b2, eps = 0.9, 0.999, 1e-8
    out, flags = [], []
    compressing = False
    for step in range(steps):
        flags.append(not compressing)
        grads: list[dict[str, np.ndarray]] = []
        for r in range(world):
            x, y = batch(r, step)
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x.double()), y.double()).backward()
            grads.append({n: p.grad.numpy().copy() for n, p in params.items()})
        with torch.no_grad():
            for n, p in params.items():
                if step == 0:
                    continue  # DeepSpeed's set-up step applies nothing
                if not compressing:
                    g = sum(gr[n] for gr in grads) / world
                    m[n] = b1 * m[n] + (1 - b1) * g
                    v[n] = b2 * v[n] + (1 - b2) * g * g
                else:
                    m[n] = comp[n].mean([b1 * m[n] + (1 - b1) * gr[n] for gr in grads])
                w = p.numpy()
                update = m[n] / (np.sqrt(v[n]) + eps) + WD * w
                p.copy_(torch.from_numpy(w - LR * update))
        if step >= 1 and step + 1 >= max(freeze, 2):
            compressing = True
        out.append({n: p.detach().numpy().copy() for n, p in params.items()})
    return out, flags


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_engine_trains_as_deepspeeds_onebit_adam(run_ranks: RunJob, world: int) -> None:
    steps = 9
    got = run_ranks(world, "tests.compression._engine_jobs:train", config(), steps)
    want, flags = reference(world, steps)
    for r in range(world):
        assert got[r]["flags"] == flags  # warm-up through step FREEZE, then local gradients
        for step in range(steps):
            for name, value in want[step].items():
                # fp32 engine against the float64 reference, through 5 compressed steps
                np.testing.assert_allclose(
                    got[r]["params"][step][name].numpy(),
                    value,
                    rtol=2e-4,
                    atol=2e-6,
                    err_msg=f"rank {r} step {step} {name}",
                )
    assert flags.count(True) == FREEZE and not flags[-1]


def test_config_names_deepspeeds_parameters_and_refuses_zero() -> None:
    cfg = load_config(config(), 2)
    assert cfg.optimizer is not None and cfg.optimizer.type == "OneBitAdam"
    assert cfg.optimizer.params["freeze_step"] == FREEZE
    with pytest.raises(ConfigError, match=r"OneBitAdam' needs zero_optimization.stage 0, got 2"):
        load_config({**config(), "zero_optimization": {"stage": 2}}, 2)
    with pytest.raises(ConfigError, match="amsgrad"):
        load_config(
            {**config(), "optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, 2
        )
    with pytest.raises(ConfigError, match="freeze_step"):
        load_config(
            {**config(), "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": -1}}}, 2
        )


def test_optimizer_refuses_bad_hyperparameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, field in (
        ({"amsgrad": True}, "amsgrad"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"eps": -1.0}, "eps"),
        ({"freeze_step": -2}, "freeze_step"),
    ):
        with pytest.raises(ValueError, match=field):
            OneBitAdam(p, **kwargs)
