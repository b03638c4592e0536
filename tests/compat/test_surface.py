"""The DeepSpeed names real programs import (docs/from-deepspeed.md, "The surface real programs
import"): each provided name imports and behaves as DeepSpeed's; tools/deepspeed_surface.py
counts names per source and resolves aliases."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import deepspeed_surface as surface  # noqa: E402

PROVIDED = [
    "ds_core.moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "ds_core.moe.utils.is_moe_param",
    "ds_core.moe.layer.MoE",
    "ds_core.utils.logger",
    "ds_core.utils.logging.logger",
    "ds_core.utils.groups._get_data_parallel_group",
    "ds_core.utils.groups._get_expert_parallel_group",
    "ds_core.utils.groups._get_sequence_parallel_group",
    "ds_core.ops.adam.DeepSpeedCPUAdam",
    "ds_core.ops.adam.FusedAdam",
    "ds_core.runtime.zero.partition_parameters.GatheredParameters",
    "ds_core.runtime.zero.partition_parameters.Init",
    "ds_core.runtime.zero.GatheredParameters",
    "ds_core.checkpointing.checkpoint",
    "ds_core.checkpointing.configure",
    "ds_core.comm.ReduceOp",
    "ds_core.DeepSpeedEngine",
    "ds_core.DeepSpeedConfig",
    *(
        f"ds_core.runtime.lr_schedules.{n}"
        for n in ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
    ),
]


@pytest.mark.parametrize("dotted", PROVIDED)
def test_provided_names_resolve(dotted: str) -> None:
    assert surface.resolves(dotted), dotted


# -- the tool ---------------------------------------------------------------------------------


def test_tool_counts_sources_and_resolves_aliases(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "pkg").mkdir(parents=True)
    b.mkdir()
    (a / "pkg" / "train.py").write_text(
        "import deepspeed\n"
        "import deepspeed.comm as dist\n"
        "from deepspeed.ops.adam import FusedAdam as FA\n"
        "from deepspeed import zero\n"
        "def f(m):\n"
        "    from deepspeed.utils import logger\n"
        "    logger.setLevel(10)\n"
        "    dist.get_rank()\n"
        "    with zero.GatheredParameters(m):\n"
        "        deepspeed.initialize(model=m)\n"
        "    return FA\n"
    )
    (a / "py2.py").write_text("print 'old'\n")
    (a / "notes.txt").write_text("import deepspeed.pipe\n")
    (b / "x.py").write_text(
        "import deepspeed as ds\nds.initialize()\nds.runtime.pipe.PipelineModule.foo()\n"
    )
    result = surface.scan([("A", a, ()), ("B", b, ())])
    uses = {n: sorted(u.sources) for n, u in result.uses.items()}
    assert uses == {
        "deepspeed.comm": ["A"],
        "deepspeed.comm.get_rank": ["A"],
        "deepspeed.ops.adam.FusedAdam": ["A"],
        "deepspeed.zero": ["A"],
        "deepspeed.zero.GatheredParameters": ["A"],
        "deepspeed.utils.logger": ["A"],
        "deepspeed.initialize": ["A", "B"],
        "deepspeed.runtime.pipe.PipelineModule": ["B"],
    }
    assert result.files == 3 and result.unparsable == ["A:py2.py"]
    only = surface.scan([("A", a, ("pkg",))])
    assert only.files == 1
    text, counts = surface.table(result, ["A", "B"])
    assert text.splitlines()[2].startswith("| `deepspeed.initialize` | 2 (A, B) | provided")
    assert "refused: DeepSpeed's pipeline internals" in text
    assert counts == {"names": 8, "provided": 7, "refused": 1, "missing": 0}


def test_tool_reads_a_bare_git_dir(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "m.py").write_text("from deepspeed.moe.layer import MoE\n")
    (work / "other.py").write_text("import deepspeed.pipe\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(work)], check=True)
    subprocess.run([*git, "-C", str(work), "add", "."], check=True)
    subprocess.run([*git, "-C", str(work), "commit", "-qm", "x"], check=True)
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    result = surface.scan([("S", bare, ("src",))])
    assert set(result.uses) == {"deepspeed.moe.layer.MoE"}


# -- MoE --------------------------------------------------------------------------------------


def test_split_params_into_moe_groups_as_deepspeed() -> None:
    from ds_core.moe.layer import MoE
    from ds_core.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from ds_core.parallel.expert.moe import MoE as CoreMoE

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2), CoreMoE(4, 8, 2))
    expert = [p for p in model.parameters() if is_moe_param(p)]
    assert len(expert) == 4 + 8  # two Linear experts; two ds_core experts of two Linears
    shared = [p for p in model.parameters() if not is_moe_param(p)]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [
            {"params": list(model.parameters()), "name": "params", "lr": 0.1},
            {"params": [], "name": "empty", "weight_decay": 0.0},
        ],
        max_group_size=40,
    )
    assert [g["name"] for g in groups[:2]] == ["params", "empty"]
    assert groups[0]["params"] == shared and groups[0].get("moe") is None
    moe = groups[2:]
    assert all(g["moe"] and g["name"] == "ep_size_1" for g in moe)
    assert [p for g in moe for p in g["params"]] == expert
    assert all(sum(p.numel() for p in g["params"]) <= 40 for g in moe)
    assert [g["lr"] for g in moe if "lr" in g] and "weight_decay" not in moe[0]
    # no max: one group per (group, expert-group name), even when empty
    again = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "p"}, max_group_size=None
    )
    assert len(again) == 2 and again[1]["params"] == expert
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer("x")  # type: ignore[arg-type]


def test_moe_layer_has_deepspeeds_signature_and_outputs() -> None:
    from ds_core.errors import ConfigError
    from ds_core.moe.layer import MoE

    torch.manual_seed(0)
    layer = MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=1, k=1)
    x = torch.randn(2, 3, 4)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and counts.sum() == 6 and counts.device.type == "cpu"
    gates = torch.softmax(layer.gate(x.reshape(-1, 4)), -1)
    mask = nn.functional.one_hot(gates.argmax(-1), 2).float()
    assert l_aux.item() == pytest.approx((gates.mean(0) * mask.mean(0)).sum().item() * 2)
    top = gates.argmax(-1)
    want = torch.stack(
        [
            layer.experts[int(e)](t) * gates[i, e]
            for i, (t, e) in enumerate(zip(x.reshape(-1, 4), top, strict=True))
        ]
    )
    assert torch.allclose(out.reshape(-1, 4), want, atol=1e-6)
    assert all(p.group_name == "ep_size_1" and not p.allreduce for p in layer.experts.parameters())
    for bad in ({"k": 2}, {"use_residual": True}, {"noisy_gate_policy": "Jitter"}):
        with pytest.raises(ConfigError):
            MoE(4, nn.Linear(4, 4), num_experts=2, **bad)


# -- optimizers -------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torchs_adam(adam_w_mode: bool) -> None:
    from ds_core.ops.adam import FusedAdam

    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(a.detach().clone())
    ours = FusedAdam([a], lr=0.1, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = ref_cls([b], lr=0.1, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(a, b, atol=1e-6)
    ours.zero_grad()
    assert a.grad is None
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([a], amsgrad=True)


# -- groups, logger, Init, ReduceOp -------------------------------------------------------


def test_groups_logger_and_reduce_op() -> None:
    import logging

    from ds_core.comm import ReduceOp
    from ds_core.utils import groups, logger

    assert isinstance(logger, logging.Logger) and logger.name == "ds_core"
    assert ReduceOp.SUM == "sum" and str(ReduceOp.MAX) == "max"
    assert groups._get_sequence_parallel_rank() == 0
    with pytest.raises(KeyError):
        groups._get_sequence_parallel_group()


def test_init_accepts_deepspeeds_arguments() -> None:
    from ds_core.errors import ConfigError
    from ds_core.runtime.zero.partition_parameters import Init

    init = Init(config_dict_or_path={"zero_optimization": {"stage": 3}}, enabled=False)
    with init:
        nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="mpu"):
        Init(mpu=object())
    # deepspeed.zero.Init is the same class: transformers and Lightning call that path
    import ds_core

    assert ds_core.zero.Init is Init


# -- lr schedules against DeepSpeed ---------------------------------------------------------

SCHEDULES: list[tuple[str, dict[str, Any]]] = [
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                  "cycle_second_step_size": 4, "cycle_first_stair_count": 2,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}),
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 0.1, "warmup_num_steps": 4}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1}),
]  # fmt: skip


def _trace(cls: Any, params: dict[str, Any], steps: int = 14) -> list[tuple[float, ...]]:
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=0.1)
    sched = cls(opt, **params)
    seen = []
    for _ in range(steps):
        g = opt.param_groups[0]
        seen.append((g["lr"], *g["betas"]))
        opt.step()
        sched.step()
    return seen


def _formula(name: str, params: dict[str, Any], it: int) -> float:
    """DeepSpeed 0.19.8's lr at iteration ``it`` (deepspeed/runtime/lr_schedules.py)."""
    if name == "WarmupLR":
        lo, hi = params.get("warmup_min_lr", 0.0), params["warmup_max_lr"]
        w = max(2, params["warmup_num_steps"])
        if it < 0:
            return lo
        if it >= w:
            return hi
        gamma = it / w if params.get("warmup_type") == "linear" else math.log(it + 1) / math.log(w)
        return lo + (hi - lo) * gamma
    if name == "WarmupDecayLR":
        w, t = max(2, params["warmup_num_steps"]), params["total_num_steps"]
        if it < 0:
            return 0.0
        gamma = math.log(it + 1) / math.log(w) if it < w else max(0.0, (t - it) / max(1, t - w))
        return params["warmup_max_lr"] * gamma
    if name == "WarmupCosineLR":
        w, t, m = (
            max(2, params["warmup_num_steps"]),
            params["total_num_steps"],
            params["warmup_min_ratio"],
        )
        if it < 0:
            return 0.0
        if it < w:
            return 0.1 * (m + (1 - m) * math.log(it + 1) / math.log(w))
        progress = min(1.0, (it - w + 1) / max(1, t - w))
        ratio = 0.0001 + (1 - 0.0001) * (1 + math.cos(math.pi * progress)) / 2
        return 0.1 * max(0.0, ratio)
    if name == "LRRangeTest":
        x = math.floor((it + 1) / params["lr_range_test_step_size"])
        return params["lr_range_test_min_lr"] * (1 + params["lr_range_test_step_rate"] * x)
    raise KeyError(name)


@pytest.mark.parametrize(("name", "params"), SCHEDULES)
def test_lr_schedules_step_as_deepspeeds(name: str, params: dict[str, Any]) -> None:
    ours = _trace(getattr(importlib.import_module("ds_core.runtime.lr_schedules"), name), params)
    if name != "OneCycle":
        for it, row in enumerate(ours):
            assert row[0] == pytest.approx(_formula(name, params, it - 1), abs=1e-12), (it, row)
    try:
        ds = importlib.import_module("deepspeed.runtime.lr_schedules")
    except Exception:  # DeepSpeed not installed (tools/install-dev.sh installs it)
        if name == "OneCycle":
            pytest.skip("deepspeed is not importable")
        return
    theirs = _trace(getattr(ds, name), params)
    flat = [v for row in ours for v in row]
    assert flat == pytest.approx([v for row in theirs for v in row], abs=1e-12)


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("steps", [0, -3, 2.5])
def test_warmup_schedules_refuse_what_deepspeeds_refuse(name: str, steps: Any) -> None:
    """DeepSpeed's warm-up schedules raise for a warm-up that is not a positive integer
    (deepspeed/runtime/lr_schedules.py); ours raise the same ValueError, naming the field."""
    cls = getattr(importlib.import_module("ds_core.runtime.lr_schedules"), name)
    opt = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=0.1)
    extra = {} if name == "WarmupLR" else {"total_num_steps": 10}
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        cls(opt, warmup_num_steps=steps, **extra)
