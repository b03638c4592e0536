"""The ZeRO stage is read in one place: :class:`ds_core.zero.placement.StagePlan`.

The engine's behaviour per stage is covered by test_zero_stages.py against single-process
PyTorch; here: the plan's table, and a scan that keeps stage-number comparisons out of the
engine (config validation reads the user's number, which is reading input, not deciding).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ds_core.zero.config import load_config
from ds_core.zero.placement import StagePlan

ROOT = Path(__file__).resolve().parents[2]

#: a comparison of something named ``stage`` with a number, or a membership test.
STAGE_READ = re.compile(r"\bstage\s*(==|!=|>=|<=|<|>)\s*\d|\bstage\s+(not\s+)?in\s*\(")
#: where the number may be read: the plan itself, and the config's validation of user input.
ALLOWED = (ROOT / "ds_core" / "zero" / "placement.py", ROOT / "ds_core" / "zero" / "config")


@pytest.mark.parametrize(
    ("stage", "gas", "expected"),
    [
        # (optimizer state, gradients, parameters partitioned; all-reduce; local accumulation)
        (0, 1, (False, False, False, True, True)),
        (0, 4, (False, False, False, True, True)),
        (1, 1, (True, False, False, False, False)),
        (1, 4, (True, False, False, False, True)),
        (2, 1, (True, True, False, False, False)),
        (2, 4, (True, True, False, False, False)),
        (3, 1, (True, True, True, False, False)),
        (3, 4, (True, True, True, False, False)),
    ],
)
def test_plan_of_each_stage(stage: int, gas: int, expected: tuple[bool, ...]) -> None:
    plan = StagePlan.for_stage(stage, gas)
    got = (
        plan.partitions_optimizer_state,
        plan.partitions_gradients,
        plan.partitions_parameters,
        plan.all_reduces_gradients,
        plan.accumulates_locally,
    )
    assert got == expected
    assert plan.stage == stage


def test_plan_from_config_reads_stage_and_accumulation() -> None:
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 3,
            "zero_optimization": {"stage": 1},
        },
        world_size=1,
    )
    assert StagePlan.from_config(cfg) == StagePlan.for_stage(1, 3)


@pytest.mark.parametrize("stage", [-1, 4])
def test_plan_refuses_an_unknown_stage(stage: int) -> None:
    with pytest.raises(ValueError, match=f"got {stage}"):
        StagePlan.for_stage(stage, 1)


def _stage_reads(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if STAGE_READ.search(line)]


def test_the_scan_catches_a_stage_comparison() -> None:
    code = "if self.stage == 3:\n    pass\nok = stage_id == 0\nif engine.stage in (1, 2):\n"
    assert _stage_reads(code) == [1, 4]


def test_only_the_plan_and_config_validation_compare_the_stage_number() -> None:
    offenders = []
    for path in sorted((ROOT / "ds_core").rglob("*.py")):
        if path == ALLOWED[0] or ALLOWED[1] in path.parents:
            continue
        for n in _stage_reads(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert not offenders, f"decide by StagePlan's flags instead: {offenders}"
