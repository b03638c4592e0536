"""1-bit LAMB (ds_core.optim.onebit_lamb) against a reference written here in float64 numpy
from DeepSpeed's ``deepspeed/runtime/fp16/onebit/lamb.py``: every rank simulated in one
process, the compressed all-reduce included; the engine's ``backward_allreduce`` switch as
DeepSpeed's ``enable_backward_allreduce``; checkpoints that resume bit for bit; bad input.

Tolerance: the optimizer runs in fp32, the reference in float64. Over ten steps the parameters
agree to 1e-5 relative (plus 1e-6 of each tensor's largest magnitude, for elements near zero);
the compression stage amplifies rounding (the gradient is reconstructed from the momentum as
``(m - b1 m_before) / (1 - b1)``, a factor 10) but stays well inside that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from ds_core.comm.compressed import padded_numel
from ds_core.optim.onebit_lamb import OneBitLamb
from tests.compression import _lamb1bit_jobs as jobs
from tests.compression.conftest import RunJob

BETAS = (0.9, 0.999)
EPS = 1e-8
MAX_COEFF, MIN_COEFF = 10.0, 0.01
COEFF_BETA = 0.9
FACTOR_MAX, FACTOR_MIN, FACTOR_THRESHOLD = 4.0, 0.5, 0.1


def group_options(i: int) -> dict[str, Any]:
    """The options of parameter ``i``'s group in the jobs' layout."""
    return next(opts for idx, opts in jobs.GROUPS if i in idx)


def grads64(rank: int, step: int) -> list[np.ndarray]:
    return [g.double().numpy() for g in jobs.rank_grads(rank, step)]


# --------------------------------------------------------------------------- the reference


def clip(x: float, low: float, high: float) -> float:
    """DeepSpeed's clamp: above ``high`` becomes ``high``, then below ``low`` becomes ``low``."""
    x = high if x > high else x
    return low if x < low else x


def lamb_step(
    p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, lr: float, weight_decay: float
) -> float:
    """One plain LAMB step as DeepSpeed's warm-up writes it (no bias correction), in place;
    returns the trust coefficient applied."""
    m *= BETAS[0]
    m += (1 - BETAS[0]) * g
    v *= BETAS[1]
    v += (1 - BETAS[1]) * g * g
    update = m / (np.sqrt(v) + EPS)
    if weight_decay > 0:
        update = update + weight_decay * p
    w, u = np.linalg.norm(p), np.linalg.norm(update)
    coeff = clip(w / u, MIN_COEFF, MAX_COEFF) if w != 0 and u != 0 else 1.0
    p -= lr * coeff * update
    return coeff


def compress(x: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Signs (zero counts as positive), scale ``||x|| / sqrt(n)`` and what they miss."""
    scale = float(np.linalg.norm(x) / np.sqrt(x.size))
    sign = np.where(x >= 0, 1.0, -1.0)
    return sign, scale, x - scale * sign


class CompressedMean:
    """Every rank's compressed all-reduce with error feedback kept across calls (the logic
    of tests/compression/test_compressed.py's reference, one call per step)."""

    def __init__(self, numel: int, world: int) -> None:
        self.numel, self.world = numel, world
        self.padded = padded_numel(numel, world)
        self.chunk = self.padded // world
        self.worker = [np.zeros(self.padded) for _ in range(world)]
        self.server = [np.zeros(self.chunk) for _ in range(world)]

    def __call__(self, inputs: list[np.ndarray]) -> np.ndarray:
        signs, scales = [], []
        for r in range(self.world):
            x = np.zeros(self.padded)
            x[: self.numel] = inputs[r]
            sign, scale, self.worker[r] = compress(x + self.worker[r])
            signs.append(sign)
            scales.append(scale)
        result = np.zeros(self.padded)
        for r in range(self.world):  # rank r reduces chunk r
            part = slice(r * self.chunk, (r + 1) * self.chunk)
            mean = sum(scales[i] * signs[i][part] for i in range(self.world)) / self.world
            sign, scale, self.server[r] = compress(mean + self.server[r])
            result[part] = scale * sign
        return result[: self.numel]


def reference(
    world: int,
    steps: int,
    freeze_step: int,
    grads: Callable[[int, int], list[np.ndarray]] = grads64,
) -> dict[str, list[Any]]:
    """DeepSpeed's 1-bit LAMB on ``world`` ranks fed ``grads(rank, step)`` (by default
    :func:`jobs.rank_grads`'s): the parameters
    after each step, ``enable_backward_allreduce`` before each step and after the last, and
    the lamb coefficients of each step."""
    params = [p.double().numpy() for p in jobs.initial_params()]
    n = len(params)
    zeros = [np.zeros_like(p) for p in params]
    m, v, fresh = [z.copy() for z in zeros], [z.copy() for z in zeros], [z.copy() for z in zeros]
    coeff_freeze, last_factor = [0.0] * n, [1.0] * n
    scaling: list[float] | None = None
    comm = CompressedMean(sum(p.size for p in params), world)
    frozen = False  # DeepSpeed's lamb_freeze_key outside its set-up step
    out: dict[str, list[Any]] = {"params": [], "flags": [], "coeffs": []}
    b1, b2 = BETAS
    for step in range(1, steps + 1):
        out["flags"].append(not frozen)
        local = [grads(r, step) for r in range(world)]
        coeffs: list[float] = []
        if step == 1:
            pass  # the set-up step: the gradient is dropped
        elif not frozen:
            for i in range(n):
                g = np.mean([local[r][i] for r in range(world)], axis=0)
                opts = group_options(i)
                c = lamb_step(params[i], m[i], v[i], g, opts["lr"], opts["weight_decay"])
                if step == freeze_step:
                    fresh[i] = v[i].copy()
                if c != 1.0:
                    coeff_freeze[i] = COEFF_BETA * coeff_freeze[i] + (1 - COEFF_BETA) * c
                coeffs.append(c)
            frozen = step >= freeze_step
        else:
            if scaling is None:
                scales = [np.linalg.norm(x) / np.sqrt(x.size) for x in m]
                scaling = [np.mean(scales) / s for s in scales]
            before = [x.copy() for x in m]
            scaled = [
                np.concatenate(
                    [((b1 * m[i] + (1 - b1) * local[r][i]) * scaling[i]).ravel() for i in range(n)]
                )
                for r in range(world)
            ]
            mean = comm(scaled) if world > 1 else scaled[0]
            offset = 0
            for i in range(n):
                m[i] = mean[offset : offset + m[i].size].reshape(m[i].shape) / scaling[i]
                offset += m[i].size
                opts = group_options(i)
                wd = opts["weight_decay"]
                grad = (m[i] - b1 * before[i]) / (1 - b1)
                fresh[i] = b2 * fresh[i] + (1 - b2) * grad * grad
                denom = np.sqrt(v[i]) + EPS
                prelim = m[i] / denom
                update = prelim + wd * params[i] if wd > 0 else prelim
                factor = float(np.max(denom / (np.sqrt(fresh[i]) + EPS)))
                if wd > 0:
                    ratio = min(1.0, np.linalg.norm(prelim) / np.linalg.norm(update))
                    factor = factor * ratio + (1 - ratio)
                factor = clip(factor, FACTOR_MIN, FACTOR_MAX)
                factor = clip(
                    factor,
                    last_factor[i] * (1 - FACTOR_THRESHOLD),
                    last_factor[i] * (1 + FACTOR_THRESHOLD),
                )
                last_factor[i] = factor
                c = coeff_freeze[i] * factor
                coeffs.append(c)
                params[i] -= opts["lr"] * c * update
        out["params"].append([p.copy() for p in params])
        out["coeffs"].append(coeffs)
    out["flags"].append(not frozen)
    return out


def deepspeed_flags(freeze_step: int, steps: int) -> list[bool]:
    """``enable_backward_allreduce`` before each of ``steps`` steps and after the last, by
    DeepSpeed's control flow (its ``initialize`` and ``lamb_freeze_key`` flags)."""
    initialized, freeze_key, enabled, counter = False, False, True, 0
    flags = []
    for _ in range(steps):
        flags.append(enabled)
        counter += 1
        if not initialized:  # the set-up step returns before the phase check
            initialized = True
            continue
        if not freeze_key and counter >= freeze_step:
            freeze_key, enabled = True, False
    flags.append(enabled)
    return flags


def assert_params_close(got: list[torch.Tensor], want: list[np.ndarray], where: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        atol = 1e-6 * float(np.max(np.abs(w)))
        np.testing.assert_allclose(
            g.double().numpy(), w, rtol=1e-5, atol=atol, err_msg=f"{where}, param {i}"
        )


# --------------------------------------------------------------------------- one rank, in process


def test_warmup_is_deepspeeds_plain_lamb() -> None:
    steps = 6
    got = jobs.train(steps, freeze_step=1000)
    params = [p.double().numpy() for p in jobs.initial_params()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    # Step 1 only sets up (DeepSpeed's quirk): nothing moves, no coefficient.
    assert_params_close(got["params"][0], params, "step 1")
    assert got["coeffs"][0] == []
    for step in range(2, steps + 1):
        grads = grads64(0, step)
        coeffs = []
        for i, p in enumerate(params):
            opts = group_options(i)
            coeffs.append(lamb_step(p, m[i], v[i], grads[i], opts["lr"], opts["weight_decay"]))
        assert_params_close(got["params"][step - 1], params, f"step {step}")
        np.testing.assert_allclose(got["coeffs"][step - 1], coeffs, rtol=1e-6)
    # both clamps were exercised: the tiny parameter at min_coeff, the large one at max_coeff
    assert got["coeffs"][-1][1] == pytest.approx(MIN_COEFF)
    assert got["coeffs"][-1][2] == pytest.approx(MAX_COEFF)
    assert got["flags"] == [True] * (steps + 1)


@pytest.mark.parametrize("freeze_step", [1, 4])
def test_one_rank_crossing_freeze_step_matches_reference(freeze_step: int) -> None:
    # A group of one rank compresses nothing (DeepSpeed skips the all-reduce) but switches
    # to the frozen variance and the scaling factor all the same. freeze_step 1: the fresh
    # variance is never seeded (no warm-up step has counter 1), so the scaling factor starts
    # at factor_max and climbs by factor_threshold; 4: it falls to factor_min.
    steps = 9
    got = jobs.train(steps, freeze_step)
    want = reference(1, steps, freeze_step)
    for s in range(steps):
        assert_params_close(got["params"][s], want["params"][s], f"step {s + 1}")
        np.testing.assert_allclose(got["coeffs"][s], want["coeffs"][s], rtol=1e-5)
    assert got["flags"] == want["flags"] == deepspeed_flags(freeze_step, steps)


@pytest.mark.parametrize("freeze_step", [0, 1, 2, 3, 5])
def test_backward_allreduce_follows_deepspeed(freeze_step: int) -> None:
    steps = 7
    assert jobs.train(steps, freeze_step)["flags"] == deepspeed_flags(freeze_step, steps)


@pytest.mark.parametrize("freeze_step", [1, 3, 5])
def test_load_sets_backward_allreduce_as_the_straight_run(freeze_step: int) -> None:
    params = [torch.zeros(3, requires_grad=True)]
    opt = OneBitLamb(params, freeze_step=freeze_step)
    for step in range(1, 7):
        params[0].grad = torch.full((3,), float(step))
        opt.step()
        fresh = OneBitLamb([torch.zeros(3, requires_grad=True)], freeze_step=freeze_step)
        fresh.load_state_dict(opt.state_dict())
        assert fresh.backward_allreduce == opt.backward_allreduce, f"after step {step}"


def test_zero_weight_takes_coefficient_one_outside_the_average() -> None:
    # DeepSpeed: no trust ratio for a zero weight (coefficient 1), and a coefficient of 1 is
    # left out of lamb_coeff_freeze.
    p = torch.zeros(3, requires_grad=True)
    opt = OneBitLamb([p], lr=0.1, freeze_step=100)
    g = torch.tensor([1.0, -2.0, 4.0])
    for _ in range(3):
        p.grad = g.clone()
        opt.step()
        if opt.state[p]["step"] == 2:
            assert opt.get_lamb_coeffs() == [1.0]
            assert float(opt.state[p]["lamb_coeff_freeze"]) == 0.0
            want = -0.1 * (0.1 * g) / (torch.sqrt(0.001 * g * g) + 1e-8)
            torch.testing.assert_close(p.detach(), want)
    (coeff,) = opt.get_lamb_coeffs()
    assert coeff != 1.0
    assert float(opt.state[p]["lamb_coeff_freeze"]) == pytest.approx((1 - COEFF_BETA) * coeff)


def test_exp_avg_mask_zeroes_the_compressed_momentum_and_stays_the_scripts() -> None:
    p = torch.ones(4, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    opt = OneBitLamb([{"params": [p], "exp_avg_mask": mask}], lr=0.01, freeze_step=2)
    for step in range(4):  # set-up, warm-up, two compressed steps
        p.grad = torch.full((4,), 1.0 + step)
        opt.step()
    m = opt.state[p]["exp_avg"]
    assert torch.equal(m[1::2], torch.zeros(2)) and bool((m[0::2] != 0).all())
    saved = opt.state_dict()
    other = torch.ones(4)
    fresh = OneBitLamb([{"params": [torch.ones(4, requires_grad=True)], "exp_avg_mask": other}])
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.param_groups[0]["exp_avg_mask"], other)


def test_state_is_complete_and_coefficients_are_copies() -> None:
    params = [torch.ones(4, requires_grad=True), torch.ones(2, 3, requires_grad=True)]
    opt = OneBitLamb(params, lr=0.1, freeze_step=2)
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 1.0 + step)
        opt.step()
    head = opt.state[params[0]]
    assert head["fused_numels"] == [4, 6]
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "lamb_coeff_freeze"):
        assert key in head
    assert {"last_factor", "scaling_coeff", "lamb_coeff"} <= set(opt.state[params[1]])
    coeffs = opt.get_lamb_coeffs()
    coeffs.clear()
    assert len(opt.get_lamb_coeffs()) == 2


def test_empty_parameters_are_left_out_and_missing_gradients_refused() -> None:
    empty, p = torch.zeros(0, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = OneBitLamb([{"params": [empty]}, {"params": [p, empty]}])
    assert [len(g["params"]) for g in opt.param_groups] == [1]
    with pytest.raises(RuntimeError, match="no gradient"):
        opt.step()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
        ({"freeze_step": -1}, "freeze_step"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"factor_min": 5.0}, "factor_min"),
        ({"coeff_beta": 1.0}, "coeff_beta"),
        ({"factor_threshold": -0.1}, "factor_threshold"),
    ],
)
def test_bad_input_is_refused_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OneBitLamb([torch.zeros(2, requires_grad=True)], **kwargs)


# --------------------------------------------------------------------------- two ranks


@pytest.mark.slow
@pytest.mark.parametrize("freeze_step", [1, 5])
def test_two_ranks_match_reference(run_ranks: RunJob, freeze_step: int) -> None:
    # freeze_step 5: step 1 set-up, 2-5 warm-up, 6-10 compressed; 1: compressed from step 3,
    # with the scaling factor clamped from above (see the one-rank test)
    steps = 10
    got = run_ranks(2, "tests.compression._lamb1bit_jobs:train", steps, freeze_step)
    want = reference(2, steps, freeze_step)
    assert want["flags"] == deepspeed_flags(freeze_step, steps)
    for r, result in enumerate(got):
        assert result["flags"] == want["flags"], f"rank {r}"
        for s in range(steps):
            assert_params_close(result["params"][s], want["params"][s], f"rank {r} step {s + 1}")
            np.testing.assert_allclose(result["coeffs"][s], want["coeffs"][s], rtol=1e-5)
        # step() itself never waits for the device (sim counts every host synchronisation):
        # all it spends is the compressed all-reduce's own, once per compressed step.
        if result["syncs"] is not None:
            compressed_steps = steps - max(freeze_step, 2)
            assert result["syncs"] == result["comm_syncs"] * compressed_steps, f"rank {r}"
    # every rank holds the same parameters after the compressed all-reduce
    for a, b in zip(got[0]["params"][-1], got[1]["params"][-1], strict=True):
        assert torch.equal(a, b)
    # the compression really ran: it differs from averaging the exact momenta
    exact = reference_without_compression(steps, freeze_step)
    assert (
        max(float(np.max(np.abs(a - b))) for a, b in zip(exact, want["params"][-1], strict=True))
        > 1e-4
    )


def reference_without_compression(steps: int, freeze_step: int) -> list[np.ndarray]:
    """The last parameters if the momenta were averaged exactly (for the sanity check above):
    one rank fed the mean gradient is what an exact mean of the momenta gives."""

    def mean_grads(rank: int, step: int) -> list[np.ndarray]:
        return [(a + b) / 2 for a, b in zip(grads64(0, step), grads64(1, step), strict=True)]

    return list(reference(1, steps, freeze_step, mean_grads)["params"][-1])


@pytest.mark.slow
@pytest.mark.parametrize("freeze_step", [3, 6])
def test_checkpoint_resumes_bitwise(run_ranks: RunJob, freeze_step: int) -> None:
    # freeze_step 3: saved mid-compression (error buffers live); 6: saved in warm-up, the
    # resumed run crosses into compression.
    got = run_ranks(2, "tests.compression._lamb1bit_jobs:resume", 4, 8, freeze_step)
    for r, runs in enumerate(got):
        straight, resumed = runs["straight"], runs["resumed"]
        assert resumed["flags"] == straight["flags"] == deepspeed_flags(freeze_step, 8)[4:8]
        for s, (a, b) in enumerate(zip(straight["params"], resumed["params"], strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"rank {r} step {s + 5} param {i}"
        assert straight["state"].keys() == resumed["state"].keys()
        for i, state in straight["state"].items():
            assert state.keys() == resumed["state"][i].keys()
            for key, value in state.items():
                other = resumed["state"][i][key]
                same = (
                    torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                )
                assert same, f"rank {r} param {i} state {key}"
        assert "worker_error" in straight["state"][0]
