"""The optimizer and scheduler sections and their builders: DeepSpeed's forms, validation
messages, torch's AdamW numerics, and the LR schedules against DeepSpeed's formulas written out
independently (DeepSpeed 0.19.8's runtime/lr_schedules.py). The rest of the schema:
test_config.py."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from ds_core import ConfigError
from ds_core.zero.compat.builders import build_optimizer, build_scheduler
from ds_core.zero.config import OptimizerConfig, SchedulerConfig, load_config
from tests.zero.test_config import error_of

# ---------------------------------------------------------------------------------------------
# optimizer


def test_optimizer_section_in_deepspeed_form() -> None:
    cfg = load_config(
        {"optimizer": {"type": "adamw", "params": {"lr": 3e-4, "weight_decay": 0.1}}}, 1
    )
    assert cfg.optimizer is not None
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["lr"] == 3e-4
    assert cfg.optimizer.params["betas"] == (0.9, 0.999)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"lr": math.nan}, "optimizer.params.lr: must be finite, got nan"),
        ({"lr": -1}, "optimizer.params.lr: must be >= 0, got -1.0"),
        ({"betas": [0.9, 1.0]}, "betas[1] must be in [0, 1), got 1.0"),
        ({"eps": 0}, "optimizer.params.eps: must be > 0, got 0.0"),
        ({"weight_decya": 0.1}, "did you mean 'optimizer.params.weight_decay'?"),
        ({"amsgrad": True}, "amsgrad: true is not supported yet"),
    ],
)
def test_optimizer_params_are_validated(params: dict[str, Any], message: str) -> None:
    assert message in error_of({"optimizer": {"type": "Adam", "params": params}})


def test_optimizer_type_errors() -> None:
    assert "optimizer.type: 'Lion' is not supported yet; use one of Adam, AdamW, Lamb" in error_of(
        {"optimizer": {"type": "Lion"}}
    )
    assert (
        "unknown type 'Adma' (one of Adam, AdamW, Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb); did you mean 'Adam'?"
        in error_of({"optimizer": {"type": "Adma"}})
    )
    assert "optimizer.type: is required" in error_of({"optimizer": {"params": {}}})
    assert "adam_w_mode: must be true for AdamW" in error_of(
        {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}
    )


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]


def test_build_optimizer_adam_is_adamw_unless_adam_w_mode_is_false() -> None:
    adamw = build_optimizer(OptimizerConfig(type="Adam", params={"lr": 0.01}), _params())
    assert type(adamw) is torch.optim.AdamW
    assert adamw.param_groups[0]["lr"] == 0.01
    assert adamw.param_groups[0]["weight_decay"] == 0.0
    adam = build_optimizer(OptimizerConfig(type="Adam", params={"adam_w_mode": False}), _params())
    assert type(adam) is torch.optim.Adam


def test_build_optimizer_uses_the_fused_cpu_kernel_when_torch_has_it() -> None:
    opt = build_optimizer(OptimizerConfig(type="AdamW"), _params())
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        torch.optim.AdamW([probe], fused=True)
        supported = True
    except RuntimeError:
        supported = False
    assert bool(opt.param_groups[0].get("fused")) is supported


def test_build_optimizer_keeps_parameter_groups() -> None:
    a, b = _params()
    opt = build_optimizer(
        OptimizerConfig(type="AdamW", params={"lr": 0.1}),
        [{"params": [a], "weight_decay": 0.5}, {"params": [b]}],
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.1]


def test_build_optimizer_matches_torch_adamw_numerically() -> None:
    torch.manual_seed(0)
    ours_p, ref_p = _params(), _params()
    for o, r in zip(ours_p, ref_p, strict=True):
        r.data.copy_(o.data)
    ours = build_optimizer(OptimizerConfig(type="AdamW", params={"lr": 0.05}), ours_p)
    ref = torch.optim.AdamW(ref_p, lr=0.05, weight_decay=0.0)
    for _ in range(3):
        for params, opt in ((ours_p, ours), (ref_p, ref)):
            opt.zero_grad()
            sum((p**2).sum() for p in params).backward()  # type: ignore[union-attr]
            opt.step()
    for o, r in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# schedules: DeepSpeed's formulas, written out independently (lr_schedules.py)


def ds_warmup_gamma(it: int, warmup: int, kind: str) -> float:
    w = max(2, warmup)
    if kind == "log":
        return math.log(it + 1) / math.log(w)
    return it / w


def ds_warmup_lr(it: int, lo: float, hi: float, warmup: int, kind: str) -> float:
    if it < 0:
        return lo
    gamma = ds_warmup_gamma(it, warmup, kind) if it < max(2, warmup) else 1.0
    return lo + (hi - lo) * gamma


def ds_warmup_decay_lr(it: int, lo: float, hi: float, warmup: int, total: int, kind: str) -> float:
    w = max(2, warmup)
    if it < 0:
        return lo
    if it < w:
        gamma = ds_warmup_gamma(it, warmup, kind)
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - w))
    return lo + (hi - lo) * gamma


def ds_warmup_cosine_lr(
    it: int, base: float, warmup: int, total: int, min_ratio: float, cos_min: float, kind: str
) -> float:
    w = max(2, warmup)
    if it < 0:
        return 0.0
    if it < w:
        ratio = min_ratio + ds_warmup_gamma(it, warmup, kind) * (1 - min_ratio)
    else:
        s, span = it - w + 1, total - w
        ratio = max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * s / span)) / 2)
    return base * ratio


def lrs_after_steps(sched_type: str, params: dict[str, Any], base_lr: float, n: int) -> list[float]:
    """lr before the first step and after each of n scheduler steps (one optimizer step each)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = build_scheduler(SchedulerConfig(type=sched_type, params=params), opt)
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(n):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    return seen


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_deepspeed(kind: str) -> None:
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}
    seen = lrs_after_steps("WarmupLR", {**params, "warmup_type": kind}, 1.0, 15)
    # after k scheduler steps DeepSpeed's last_batch_iteration is k - 1
    expected = [ds_warmup_lr(k - 1, 0.01, 0.1, 10, kind) for k in range(16)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[0] == seen[1] == 0.01 and seen[-1] == pytest.approx(0.1)
    assert seen[5] < seen[6] < seen[10]


def test_warmup_lr_max_defaults_to_the_optimizer_lr() -> None:
    seen = lrs_after_steps("WarmupLR", {"warmup_num_steps": 2}, 0.3, 4)
    assert seen[-1] == pytest.approx(0.3)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_matches_deepspeed(kind: str) -> None:
    params = {"warmup_max_lr": 0.2, "warmup_num_steps": 5, "total_num_steps": 20}
    seen = lrs_after_steps("WarmupDecayLR", {**params, "warmup_type": kind}, 1.0, 25)
    expected = [ds_warmup_decay_lr(k - 1, 0.0, 0.2, 5, 20, kind) for k in range(26)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert seen[6] == pytest.approx(0.2)  # iteration 5: end of warm-up, start of decay
    assert seen[21:] == [0.0] * 5  # decayed to 0 at total_num_steps and held


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_deepspeed(kind: str) -> None:
    params = {
        "total_num_steps": 30,
        "warmup_num_steps": 6,
        "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.05,
        "warmup_type": kind,
    }
    # Up to total_num_steps; past it DeepSpeed holds the floor (checked against DeepSpeed's
    # own class in tests/compat/test_surface.py).
    seen = lrs_after_steps("WarmupCosineLR", params, 0.5, 30)
    expected = [ds_warmup_cosine_lr(k - 1, 0.5, 6, 30, 0.1, 0.05, kind) for k in range(31)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert seen[0] == 0.0
    # DeepSpeed's cosine counts from 1 after warm-up: its floor is at iteration total - 1
    assert seen[30] == pytest.approx(0.5 * 0.05)


def test_schedule_resumes_from_last_batch_iteration() -> None:
    params = {"warmup_max_lr": 0.2, "warmup_num_steps": 5, "total_num_steps": 20}
    full = lrs_after_steps("WarmupDecayLR", params, 1.0, 12)
    resumed = lrs_after_steps("WarmupDecayLR", {**params, "last_batch_iteration": 7}, 1.0, 4)
    assert resumed == pytest.approx(full[8:])


def test_schedule_per_group_learning_rates() -> None:
    a, b = _params()
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=1.0)
    cfg = SchedulerConfig(
        type="WarmupLR",
        params={"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 0.2], "warmup_num_steps": 2},
    )
    sched = build_scheduler(cfg, opt)
    for _ in range(4):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.2])
    bad = SchedulerConfig(type="WarmupLR", params={"warmup_min_lr": [0.0, 0.1, 0.2]})
    with pytest.raises(ConfigError, match="has 3 values but the optimizer has 2 parameter"):
        build_scheduler(bad, opt)


@pytest.mark.parametrize(
    ("sched_type", "params", "message"),
    [
        ("WarmupLR", {"warmup_num_steps": -1}, "warmup_num_steps: must be > 0, got -1"),
        ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 0}, "must be > 0, got 0"),
        ("WarmupLR", {"warmup_max_lr": math.inf}, "warmup_max_lr: must be finite, got inf"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, "must be >= 0, got -0.1"),
        ("WarmupLR", {"warmup_type": "cubic"}, "warmup_type: input should be 'log' or 'linear'"),
        (
            "WarmupDecayLR",
            {"total_num_steps": 10, "warmup_num_steps": 10},
            "total_num_steps (10) must be greater than warmup_num_steps (10)",
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 2, "warmup_num_steps": 1},
            "total_num_steps (2) must be greater than warmup_num_steps (1, raised to 2",
        ),
        ("WarmupCosineLR", {}, "scheduler.params.total_num_steps: is required"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 10, "cos_min_ratio": 2},
            "cos_min_ratio: must be <= 1, got 2",
        ),
    ],
)
def test_schedule_params_are_validated(
    sched_type: str, params: dict[str, Any], message: str
) -> None:
    assert message in error_of({"scheduler": {"type": sched_type, "params": params}})


def test_scheduler_type_errors() -> None:
    assert "scheduler.type: 'OneCycle' is not supported yet" in error_of(
        {"scheduler": {"type": "OneCycle"}}
    )
    assert "did you mean 'WarmupLR'?" in error_of({"scheduler": {"type": "WarmupLr2"}})


def test_builders_validate_directly_constructed_sections() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("scheduler.params.warmup_num_steps: must be > 0")
    ):
        build_scheduler(
            SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": -3}),
            torch.optim.SGD(_params(), lr=0.1),
        )
    with pytest.raises(ConfigError, match=re.escape("optimizer.type: unknown type 'Sgd'")):
        build_optimizer(OptimizerConfig(type="Sgd"), _params())
