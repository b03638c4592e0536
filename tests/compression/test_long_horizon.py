"""1-bit Adam, 0/1 Adam and 1-bit LAMB over 400 steps on 2 real ranks, against the float64
simulations of DeepSpeed's algorithms (``deepspeed/runtime/fp16/onebit/adam.py``,
``zoadam.py``, ``lamb.py``; the compressed all-reduce of ``deepspeed/runtime/comm/nccl.py``)
fed the same gradients: the short tests check the formulas step by step; these check that
nothing drifts over the hundreds of compressed steps a training run takes (an error buffer
that leaks, a schedule counter that slips, a scale that accumulates rounding).

The drift measure: per step, the largest ``|fp32 - float64|`` over a tensor's elements and
every rank, over that tensor's largest ``|float64|``. The float64 simulation of 1-bit Adam
rerun in float32 (:func:`onebit_adam_reference` with ``dtype=np.float32``) gives the rounding
level of the algorithm itself; every optimizer stays at it (run with ``-s`` for the figures).
Measured (2 ranks, cpu; freeze after step 45): parameters 1.0-1.8 × 10⁻⁶ at most over the 400
steps for every optimizer, against 1.4 × 10⁻⁶ for the float32 rerun; 1-bit Adam's momentum and
error buffers 2.4 × 10⁻⁶; no growth over the 355 compressed steps (a leak would grow with
them). Tolerance: 2 × 10⁻⁵, about 10× the measured. On the cpu backend only: what is checked is
arithmetic over many steps; the short tests run every backend of the matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.compression import _horizon_jobs as hjobs
from tests.compression import _lamb1bit_jobs as ljobs
from tests.compression import _zoadam_jobs as zjobs
from tests.compression import test_onebit_lamb as lamb_ref
from tests.compression import test_zero_one_adam as zo_ref
from tests.compression.conftest import RunJob
from tests.compression.test_onebit_adam import Compressor


class TypedCompressor(Compressor):
    """test_onebit_adam's all-ranks compressed mean, with every array in ``dtype``."""

    def __init__(self, numel: int, world: int, dtype: Any) -> None:
        super().__init__(numel, world)
        self.dtype = dtype
        self.worker = [w.astype(dtype) for w in self.worker]
        self.server = [x.astype(dtype) for x in self.server]

    @staticmethod
    def _compress(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scale = (np.linalg.norm(x) / np.sqrt(x.size)).astype(x.dtype)
        sign = np.where(x >= 0, 1.0, -1.0).astype(x.dtype)
        return scale * sign, x - scale * sign

    def mean(self, per_rank: list[np.ndarray]) -> np.ndarray:
        chunk = self.padded // self.world
        sent = []
        for r, x in enumerate(per_rank):
            full = np.zeros(self.padded, dtype=self.dtype)
            full[: self.numel] = x.reshape(-1)
            approx, self.worker[r] = self._compress(full + self.worker[r])
            sent.append(approx)
        out = np.zeros(self.padded, dtype=self.dtype)
        for r in range(self.world):
            part = slice(r * chunk, (r + 1) * chunk)
            total = sum(s[part] for s in sent) * self.dtype(1.0 / self.world)
            approx, self.server[r] = self._compress(total + self.server[r])
            out[part] = approx
        return out[: self.numel].reshape(per_rank[0].shape)


STEPS, FREEZE, WORLD = 400, 45, 2
REPORT_AT = (FREEZE, 100, 200, 300, 400)
TOL = 2e-5


def onebit_adam_reference(
    world: int, steps: int, freeze: int, dtype: Any = np.float64
) -> dict[str, Any]:
    """DeepSpeed's 1-bit Adam (adam.py) on ``world`` simulated ranks fed
    :func:`hjobs.rank_grad`, in ``dtype``: the parameters after each step (the same on every
    rank), ``exp_avg`` after each step, and every 100 steps each rank's error buffers
    (``errors[step][i]`` = (worker errors by rank, server errors by rank) of parameter ``i``)."""
    n = len(hjobs.SHAPES)
    p = [hjobs.initial(i).double().numpy().astype(dtype) for i in range(n)]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    comp = [TypedCompressor(x.size, world, dtype) for x in p]
    b1, b2 = dtype(0.9), dtype(0.999)
    lr, wd, eps = dtype(hjobs.LR), dtype(hjobs.WEIGHT_DECAY), dtype(1e-8)
    out: dict[str, Any] = {"params": [], "exp_avg": [], "errors": {}}
    compressing = False
    for step in range(1, steps + 1):
        local = [
            [hjobs.rank_grad(r, step, i).double().numpy().astype(dtype) for i in range(n)]
            for r in range(world)
        ]
        for i in range(n):
            if step == 1:
                continue  # DeepSpeed's set-up step applies nothing
            if not compressing:
                g = sum(local[r][i] for r in range(world)) / dtype(world)
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
            else:
                m[i] = comp[i].mean([b1 * m[i] + (1 - b1) * local[r][i] for r in range(world)])
            p[i] = p[i] - lr * (m[i] / (np.sqrt(v[i]) + eps) + wd * p[i])
        if step >= max(freeze, 2):
            compressing = True
        out["params"].append([x.copy() for x in p])
        out["exp_avg"].append([x.copy() for x in m])
        if step % 100 == 0:
            out["errors"][step] = [([*c.worker], [*c.server]) for c in comp]
    return out


def drift(got: np.ndarray, want: np.ndarray) -> float:
    """``max |got - want|`` over ``max |want|``."""
    scale = float(np.max(np.abs(want)))
    return float(np.max(np.abs(got.astype(np.float64) - want))) / (scale or 1.0)


def report(name: str, per_step: list[float]) -> None:
    cells = "  ".join(f"@{s} {per_step[s - 1]:.1e}" for s in REPORT_AT if s <= len(per_step))
    print(f"\n{name:<32} drift {cells}  (max {max(per_step):.1e})")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu"], indirect=True)
def test_onebit_adam_stays_at_rounding_level(run_ranks: RunJob) -> None:
    got = run_ranks(WORLD, "tests.compression._horizon_jobs:onebit_adam", STEPS, FREEZE, 100)
    want = onebit_adam_reference(WORLD, STEPS, FREEZE)
    f32 = onebit_adam_reference(WORLD, STEPS, FREEZE, np.float32)
    n = len(hjobs.SHAPES)
    rounding = [
        max(drift(f32["params"][s][i], want["params"][s][i]) for i in range(n))
        for s in range(STEPS)
    ]
    report("1-bit Adam: f32 reference", rounding)
    per_step = [
        max(
            drift(res["params"][s][i].numpy(), want["params"][s][i])
            for res in got
            for i in range(n)
        )
        for s in range(STEPS)
    ]
    report("1-bit Adam: ds_core params", per_step)
    for step, states in got[0]["state"].items():
        for i, state in enumerate(states):
            d = drift(state["exp_avg"].numpy(), want["exp_avg"][step - 1][i])
            assert d < TOL, f"exp_avg of param {i} at step {step}: {d:.2e}"
            worst = d
            workers, servers = want["errors"][step][i]
            for r, res in enumerate(got):
                mine = res["state"][step][i]
                for key, ref in (("worker_error", workers[r]), ("server_error", servers[r])):
                    d = drift(mine[key].numpy(), ref)
                    assert d < TOL, f"{key} of param {i} on rank {r} at step {step}: {d:.2e}"
                    worst = max(worst, d)
            print(f"  step {step} param {i}: exp_avg and error buffers drift {worst:.1e}")
    # each rank's error buffers are its own (the comparison above is not of zeros)
    last = [res["state"][STEPS][0]["worker_error"].numpy() for res in got]
    assert not np.array_equal(last[0], last[1]) and np.abs(last[0]).max() > 0
    assert max(per_step) < TOL, f"1-bit Adam drifts to {max(per_step):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu"], indirect=True)
@pytest.mark.parametrize(
    "schedule",
    [
        {},  # DeepSpeed's defaults: every frozen step syncs
        {"local_step_scaler": 8, "local_step_clipper": 4},  # local steps of 1, 2, 4
    ],
    ids=["defaults", "local-steps"],
)
def test_zero_one_adam_stays_at_rounding_level(run_ranks: RunJob, schedule: dict[str, int]) -> None:
    cfg = {"lr": 1e-3, "weight_decay": 0.01, "var_freeze_step": FREEZE}
    cfg |= {"var_update_scaler": 16, "local_step_scaler": 32678, "local_step_clipper": 16}
    cfg |= schedule
    got = run_ranks(WORLD, "tests.compression._zoadam_jobs:run", cfg, STEPS, [])
    refs = [zo_ref.reference(i, WORLD, STEPS, cfg) for i in range(len(zjobs.SHAPES))]
    assert got[0]["flags"] == [flag for _, flag, _ in zo_ref.schedule(STEPS, cfg)]
    per_step = [
        max(
            drift(res["params"][s][i].numpy(), refs[i][s][r])
            for r, res in enumerate(got)
            for i in range(len(zjobs.SHAPES))
        )
        for s in range(STEPS)
    ]
    report(f"0/1 Adam ({'defaults' if not schedule else 'local steps'})", per_step)
    assert max(per_step) < TOL, f"0/1 Adam drifts to {max(per_step):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu"], indirect=True)
def test_onebit_lamb_stays_at_rounding_level(run_ranks: RunJob) -> None:
    got = run_ranks(WORLD, "tests.compression._lamb1bit_jobs:train", STEPS, FREEZE)
    want = lamb_ref.reference(WORLD, STEPS, FREEZE)
    assert got[0]["flags"] == want["flags"]
    per_step = [
        max(
            drift(res["params"][s][i].numpy(), want["params"][s][i])
            for res in got
            for i in range(len(ljobs.SHAPES))
        )
        for s in range(STEPS)
    ]
    report("1-bit LAMB", per_step)
    coeffs = max(
        abs(a - b) / abs(b)
        for res in got
        for s in range(1, STEPS)
        for a, b in zip(res["coeffs"][s], want["coeffs"][s], strict=True)
    )
    print(f"  lamb coefficients: largest relative difference {coeffs:.1e}")
    assert max(per_step) < TOL, f"1-bit LAMB drifts to {max(per_step):.2e}"
    assert coeffs < TOL
