"""The determinism hook: it names what it set, makes training bitwise repeatable, and undoes."""

from __future__ import annotations

import os
from typing import Any

import pytest
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
    env_after = dict(os.environ)
    leaked = sorted(
        k for k in set(env_before) | set(env_after) if env_before.get(k) != env_after.get(k)
    )
    check(not leaked, "environment variables left changed", leaked, "none", "apply + restore")
    now = torch.are_deterministic_algorithms_enabled()
    check(
        now == algos_before,
        "torch.are_deterministic_algorithms_enabled() after restore",
        now,
        str(algos_before),
        "ds_determinism_restore",
    )


def _torch_globals() -> dict[str, Any]:
    """Global torch settings a determinism policy might touch, read without a device context."""
    backends = torch.backends
    out: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn.deterministic": backends.cudnn.deterministic,
        "cudnn.benchmark": backends.cudnn.benchmark,
        "mkldnn.enabled": backends.mkldnn.enabled,
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
    }
    return out


@hooks("ds_determinism_apply", "ds_determinism_restore")
@pytest.mark.parametrize("already_on", [False, True], ids=["from-off", "from-on"])
def test_apply_changes_only_what_it_records_and_restore_returns_every_setting(
    acc: Any, already_on: bool
) -> None:
    """Environment and torch's global settings: after apply, exactly the recorded variables
    changed (to the recorded values); after restore, everything equals the state before,
    including when determinism was already on (restore must not just switch it off), and
    when two applications are undone in reverse order."""
    start_algos = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(already_on)
    try:
        env0, globals0 = dict(os.environ), _torch_globals()
        first = acc.set_deterministic(True)
        env1 = dict(os.environ)
        changed = {k for k in set(env0) | set(env1) if env0.get(k) != env1.get(k)}
        check(
            changed == set(first.env),
            "environment variables changed by apply",
            sorted(changed),
            f"exactly the recorded ones {sorted(first.env)}",
            "ds_determinism_apply(True)",
        )
        now = torch.are_deterministic_algorithms_enabled()
        check(
            now is True,
            "torch.are_deterministic_algorithms_enabled() after apply(True)",
            now,
            "True",
            "ds_determinism_apply(True)",
        )
        second = acc.set_deterministic(True)  # nested: a second policy over the first
        acc.restore_determinism(second)
        check(
            dict(os.environ) == env1 and torch.are_deterministic_algorithms_enabled(),
            "state after apply, apply, restore(second)",
            "changed",
            "the state after the first apply",
            "ds_determinism_restore (nested)",
        )
        acc.restore_determinism(first)
        env2, globals2 = dict(os.environ), _torch_globals()
        leaked = sorted(k for k in set(env0) | set(env2) if env0.get(k) != env2.get(k))
        check(not leaked, "environment variables left changed", leaked, "none", "restore")
        differ = {k: (globals0[k], v) for k, v in globals2.items() if globals0[k] != v}
        check(
            not differ,
            "torch settings (before, after) apply + restore",
            differ,
            "unchanged",
            "ds_determinism_restore",
        )
    finally:
        torch.use_deterministic_algorithms(start_algos)


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
