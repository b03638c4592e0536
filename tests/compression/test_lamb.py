"""ds_core.optim.lamb.Lamb against a float64 numpy reference written here from DeepSpeed's
FusedLamb kernel (csrc/lamb/fused_lamb_cuda_kernel.cu): moments uncorrected, eps outside or
inside the root, weight decay in the update, trust ratio ||p|| / ||u|| clamped to
[min_coeff, max_coeff] (1 when either norm is zero), bias correction folded into the step size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from ds_core.optim.lamb import Lamb

# fp32 against float64: the step is a handful of elementwise ops and two norms, so 1e-5 relative
# (atol for elements that pass near zero). float64 against float64: only summation order differs.
RTOL32, ATOL32 = 1e-5, 1e-7
RTOL64, ATOL64 = 1e-12, 1e-14

STEPS = 5
SHAPES: list[tuple[int, ...]] = [(7,), (4, 5), (2, 3, 4), (1,)]


@dataclass
class Hyper:
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    eps_inside_sqrt: bool = False
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    kwargs: dict[str, Any] = field(default_factory=dict)


def ref_step(
    p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, h: Hyper
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """One step of the kernel's math in float64; returns (p, m, v, coefficient)."""
    b1, b2 = h.betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v + h.eps) if h.eps_inside_sqrt else np.sqrt(v) + h.eps
    u = m / denom + h.weight_decay * p
    w_norm = float(np.sqrt(np.sum(p * p)))
    u_norm = float(np.sqrt(np.sum(u * u)))
    coeff = 1.0
    if w_norm != 0.0 and u_norm != 0.0:
        coeff = w_norm / u_norm
        if coeff > h.max_coeff:
            coeff = h.max_coeff
        if coeff < h.min_coeff:
            coeff = h.min_coeff
    step_size = h.lr
    if h.bias_correction:
        step_size = h.lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    return p - step_size * coeff * u, m, v, coeff


def initial(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * scale


def grad_at(shape: tuple[int, ...], seed: int, step: int) -> np.ndarray:
    return np.random.default_rng(1000 * seed + step).standard_normal(shape)


def run_pair(
    h: Hyper,
    inits: list[np.ndarray],
    dtype: torch.dtype = torch.float32,
    zero_grad: tuple[int, ...] = (),
    steps: int = STEPS,
) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]], list[list[float]], list[list[float]]]:
    """Both implementations over ``steps`` on the same data; per step, the parameters and
    coefficients of each. Parameters whose index is in ``zero_grad`` get all-zero gradients."""
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in inits]
    opt = Lamb(
        params,
        lr=h.lr,
        betas=h.betas,
        eps=h.eps,
        weight_decay=h.weight_decay,
        bias_correction=h.bias_correction,
        eps_inside_sqrt=h.eps_inside_sqrt,
        max_coeff=h.max_coeff,
        min_coeff=h.min_coeff,
    )
    ref_p = [x.astype(np.float64) for x in inits]
    ref_m = [np.zeros_like(x) for x in ref_p]
    ref_v = [np.zeros_like(x) for x in ref_p]
    got_ps, want_ps, got_cs, want_cs = [], [], [], []
    for t in range(1, steps + 1):
        want_c = []
        for i, p in enumerate(params):
            g = np.zeros(p.shape) if i in zero_grad else grad_at(tuple(p.shape), i, t)
            # the reference sees exactly the gradient values the optimizer sees
            p.grad = torch.tensor(g, dtype=dtype)
            g64 = p.grad.double().numpy()
            ref_p[i], ref_m[i], ref_v[i], c = ref_step(ref_p[i], g64, ref_m[i], ref_v[i], t, h)
            want_c.append(c)
        opt.step()
        got_ps.append([p.detach().double().numpy().copy() for p in params])
        want_ps.append([x.copy() for x in ref_p])
        got_cs.append(opt.get_lamb_coeffs())
        want_cs.append(want_c)
    return got_ps, want_ps, got_cs, want_cs


def assert_match(
    got: tuple[
        list[list[np.ndarray]], list[list[np.ndarray]], list[list[float]], list[list[float]]
    ],
    rtol: float = RTOL32,
    atol: float = ATOL32,
) -> None:
    got_ps, want_ps, got_cs, want_cs = got
    for t, (gp, wp, gc, wc) in enumerate(zip(got_ps, want_ps, got_cs, want_cs, strict=True), 1):
        for i, (a, b) in enumerate(zip(gp, wp, strict=True)):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"step {t} param {i}")
        np.testing.assert_allclose(gc, wc, rtol=rtol, err_msg=f"coefficients at step {t}")


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_matches_reference(
    weight_decay: float, bias_correction: bool, eps_inside_sqrt: bool
) -> None:
    # eps large enough that moving it inside the root changes the result well past the tolerance
    h = Hyper(
        eps=1e-3,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
        eps_inside_sqrt=eps_inside_sqrt,
    )
    inits = [initial(s, i) for i, s in enumerate(SHAPES)]
    assert_match(run_pair(h, inits))


def test_float64_parameters_match_tightly() -> None:
    h = Hyper(weight_decay=0.01, eps=1e-6)
    inits = [initial(s, i) for i, s in enumerate(SHAPES)]
    assert_match(run_pair(h, inits, dtype=torch.float64), rtol=RTOL64, atol=ATOL64)


def test_zero_weight_norm_and_zero_update_norm_use_coefficient_one() -> None:
    # param 0 starts at zero (||p|| = 0 on step 1); param 1 is zero with zero gradients and no
    # weight decay, so its update is zero on every step; param 2 is an ordinary one.
    h = Hyper()
    inits = [np.zeros((3, 4)), np.zeros((5,)), initial((6,), 2)]
    result = run_pair(h, inits, zero_grad=(1,))
    assert_match(result)
    _, want_ps, got_cs, want_cs = result
    assert want_cs[0][0] == 1.0 and got_cs[0][0] == 1.0
    assert all(c[1] == 1.0 for c in got_cs)
    assert not np.array_equal(want_ps[0][0], 0.0)  # the zero parameter did move
    assert np.array_equal(want_ps[-1][1], np.zeros(5))


def test_coefficient_clamped_to_max_and_min() -> None:
    # ||p|| / ||u|| is about 1 for unit-scale data; a 1e-4-scale parameter sits near 1e-4.
    h = Hyper(max_coeff=0.1, min_coeff=0.05, weight_decay=0.01)
    inits = [initial((4, 5), 0), initial((7,), 1, scale=1e-4), initial((3, 3), 2)]
    result = run_pair(h, inits)
    assert_match(result)
    want_cs = result[3]
    assert all(c[0] == 0.1 and c[2] == 0.1 for c in want_cs), want_cs
    assert all(c[1] == 0.05 for c in want_cs), want_cs


def test_min_coeff_wins_when_above_max_coeff() -> None:
    # The kernel caps at max_coeff, then raises to min_coeff.
    h = Hyper(max_coeff=0.1, min_coeff=0.2)
    result = run_pair(h, [initial((5,), 0), initial((2, 2), 1, scale=1e-6)])
    assert_match(result)
    assert all(c == [0.2, 0.2] for c in result[3])
    # the optimizer's coefficient is 0.2 rounded to float32
    assert all(c == [float(np.float32(0.2))] * 2 for c in result[2])


@pytest.mark.parametrize(
    "change",
    [
        {"eps_inside_sqrt": True},
        {"bias_correction": False},
        {"weight_decay": 0.05},
        {"max_coeff": 0.5},
        {"betas": (0.8, 0.999)},
    ],
)
def test_reference_tells_options_apart(change: dict[str, Any]) -> None:
    """The comparison can fail: the optimizer run with one option changed does not pass
    against the reference of the unchanged options."""
    base = Hyper(eps=1e-3)
    inits = [initial(s, i) for i, s in enumerate(SHAPES)]
    got = run_pair(Hyper(**{**base.__dict__, **change}), inits)
    want = run_pair(base, inits)
    with pytest.raises(AssertionError):
        assert_match((got[0], want[1], got[2], want[3]))


def test_parameter_without_grad_is_skipped() -> None:
    a = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))
    b = torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(1)))
    c = torch.nn.Parameter(torch.randn(2, generator=torch.Generator().manual_seed(2)))
    before = b.detach().clone()
    opt = Lamb([a, b, c], lr=0.1)
    for _ in range(2):
        a.grad = torch.ones_like(a)
        c.grad = torch.ones_like(c)
        opt.step()
    assert torch.equal(b, before)
    assert len(opt.state[b]) == 0
    assert opt.state[a]["step"] == 2
    assert len(opt.get_lamb_coeffs()) == 2


def _model_and_data(seed: int) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(6)]
    return params, grads


def _train(opt: Lamb, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


def test_state_dict_round_trip_resumes_bitwise() -> None:
    kwargs: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.01, "eps_inside_sqrt": True}
    straight, grads = _model_and_data(0)
    _train(Lamb(straight, **kwargs), straight, grads)

    first, _ = _model_and_data(0)
    opt = Lamb(first, **kwargs)
    _train(opt, first, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in first]

    resumed = [torch.nn.Parameter(x) for x in saved_params]
    fresh = Lamb(resumed, **kwargs)
    fresh.load_state_dict(saved)
    _train(fresh, resumed, grads[3:])

    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    assert fresh.state[resumed[0]]["step"] == 6


def test_no_host_sync_in_step() -> None:
    # Meta tensors have no values: any .item() or branch on a tensor inside step() would raise.
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in SHAPES]
    opt = Lamb(params, weight_decay=0.01)
    for p in params:
        p.grad = torch.empty_like(p)
    opt.step()
    assert all(opt.state[p]["exp_avg"].device.type == "meta" for p in params)


def test_amsgrad_refused() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        Lamb([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


def test_max_grad_norm_refused() -> None:
    with pytest.raises(ValueError, match="max_grad_norm"):
        Lamb([torch.nn.Parameter(torch.zeros(2))], max_grad_norm=1.0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"lr": -1.0}, "lr"), ({"eps": -1e-8}, "eps"), ({"betas": (0.9, 1.0)}, "betas")],
)
def test_out_of_range_refused(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Lamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_gradient_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb([p]).step()


def test_defaults_are_deepspeeds() -> None:
    opt = Lamb([torch.nn.Parameter(torch.zeros(2))])
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    assert group["bias_correction"] is True and group["weight_decay"] == 0.0
    assert group["max_coeff"] == 10.0 and group["min_coeff"] == 0.01
    assert group["max_grad_norm"] == 0.0 and opt.eps_inside_sqrt is False
    assert opt.get_lamb_coeffs() == []


def test_closure_loss_returned() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = Lamb([p])

    def closure() -> float:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) == 3.0
    assert not torch.equal(p, torch.ones(3))
