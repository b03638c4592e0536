"""The determinism hook: it names what it set, makes training bitwise repeatable, and undoes."""

from __future__ import annotations

import os
from typing import Any

import torch

from ds_conformance.helpers import check
from ds_conformance.marks import capability, hooks, tier

pytestmark = tier("basic")


def _train(acc: Any) -> list[torch.Tensor]:
    acc.manual_seed(0)
    device = acc.device()
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(5, 16, 32, device=device)
    target = torch.randn(5, 16, 1, device=device)
    for x, y in zip(data, target, strict=True):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    acc.synchronize()
    return [p.detach().cpu().clone() for p in model.parameters()]


@hooks("ds_determinism_apply", "ds_determinism_restore")
def test_record_names_what_was_set_and_restore_undoes_it(acc: Any) -> None:
    env_before = dict(os.environ)
    algos_before = torch.are_deterministic_algorithms_enabled()
    record = acc.set_deterministic(True)
    try:
        check(
            bool(record.settings or record.env),
            "record.settings/env",
            (record.settings, record.env),
            "at least one named setting",
            "ds_determinism_apply(True)",
        )
        for var, (_old, new) in record.env.items():
            check(
                os.environ.get(var) == new,
                f"os.environ[{var!r}]",
                os.environ.get(var),
                repr(new),
                "ds_determinism_apply(True)",
            )
    finally:
        acc.restore_determinism(record)
    for var in record.env:
        check(
            os.environ.get(var) == env_before.get(var),
            f"os.environ[{var!r}] after restore",
            os.environ.get(var),
            repr(env_before.get(var)),
            "ds_determinism_restore",
        )
    now = torch.are_deterministic_algorithms_enabled()
    check(
        now == algos_before,
        "torch.are_deterministic_algorithms_enabled() after restore",
        now,
        str(algos_before),
        "ds_determinism_restore",
    )


@capability("determinism")
@hooks("ds_determinism_apply")
def test_two_training_runs_are_bitwise_equal(acc: Any) -> None:
    record = acc.set_deterministic(True)
    try:
        first, second = _train(acc), _train(acc)
    finally:
        acc.restore_determinism(record)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        check(
            torch.equal(a, b),
            f"parameter {i} after two equal runs",
            "different",
            "bitwise equal",
            "set_deterministic(True); train twice",
        )
