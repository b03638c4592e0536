"""The determinism hook: it names what it set, makes training bitwise repeatable, and undoes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ds_conformance.helpers import check, run_python
from ds_conformance.marks import capability, hooks, promise, tier

pytestmark = tier("basic")


def _seed_all(acc: Any, seed: int) -> None:
    """Seed every generator a module or its data may draw from: modules initialise from the
    host generator even when moved to the device afterwards; device draws use the device's."""
    torch.manual_seed(seed)
    acc.manual_seed_all(seed)


def _train(acc: Any) -> list[torch.Tensor]:
    _seed_all(acc, 0)
    device = acc.device()
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(5, 16, 32, device=device)
    target = torch.randn(5, 16, 1, device=device)
    for x, y in zip(data, target, strict=True):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is untyped
        opt.step()
    acc.synchronize()
    return [p.detach().cpu().clone() for p in model.parameters()]


@hooks("ds_determinism_apply", "ds_determinism_restore")
@promise(
    "ds_determinism_apply",
    "Turn deterministic execution on or off for this device and record every change made.",
)
@promise("ds_determinism_apply", "Returns the previous and new value of each setting")
@promise("ds_determinism_restore", "Undo a ``ds_determinism_apply``")
@promise("ds_determinism_restore", ":returns: ``True`` once every setting is restored")
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
        restored = acc.restore_determinism(record)
    # the spec's return value, True: False or None is a broken implementation
    check(restored is True, "return value", restored, "True", "ds_determinism_restore")
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


_SIDE_EFFECTS = """
import json, os, torch
from ds_core import get_accelerator

def torch_globals():
    b = torch.backends
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn.deterministic": b.cudnn.deterministic,
        "cudnn.benchmark": b.cudnn.benchmark,
        "mkldnn.enabled": b.mkldnn.enabled,
    }

def changed(a, b):
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))

acc = get_accelerator()
out = {}
for already_on in (False, True):
    torch.use_deterministic_algorithms(already_on)
    env0, globals0 = dict(os.environ), torch_globals()
    first = acc.set_deterministic(True)
    env1, on = dict(os.environ), torch.are_deterministic_algorithms_enabled()
    second = acc.set_deterministic(True)  # nested: a second policy over the first
    acc.restore_determinism(second)
    env_nested, on_nested = dict(os.environ), torch.are_deterministic_algorithms_enabled()
    acc.restore_determinism(first)
    env2, globals2 = dict(os.environ), torch_globals()
    out["from-on" if already_on else "from-off"] = {
        "applied_env": changed(env0, env1), "recorded_env": sorted(first.env),
        "on_after_apply": on, "nested_env": changed(env1, env_nested), "on_nested": on_nested,
        "leaked_env": changed(env0, env2),
        "settings": {k: [globals0[k], v] for k, v in globals2.items() if globals0[k] != v},
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def side_effects(request: pytest.FixtureRequest) -> dict[str, Any]:
    """apply/restore in a fresh process, from the environment this run started with, so no
    other test's (or torch's lazily set) variables hide or fake a change."""
    from ds_conformance.plugin import suite_of

    base = suite_of(request.config).env_at_start
    return run_python(_SIDE_EFFECTS, base_env=base)  # type: ignore[no-any-return]


@hooks("ds_determinism_apply", "ds_determinism_restore")
@pytest.mark.parametrize("start", ["from-off", "from-on"])
@promise("ds_determinism_apply", ":param enabled:")
def test_apply_changes_only_what_it_records_and_restore_returns_every_setting(
    side_effects: dict[str, Any], start: str
) -> None:
    """After apply, exactly the recorded variables changed and the setting holds; a nested
    apply + restore returns to the first policy; after the last restore the environment and
    torch's global settings equal those before — also when determinism was already on
    (restore must return to the old value, not switch it off)."""
    r = side_effects[start]
    call = f"ds_determinism_apply(True) {start}"
    check(
        r["applied_env"] == r["recorded_env"],
        "environment variables changed by apply",
        r["applied_env"],
        f"exactly the recorded ones {r['recorded_env']}",
        call,
    )
    check(r["on_after_apply"], "deterministic algorithms after apply", False, "True", call)
    check(
        not r["nested_env"] and r["on_nested"],
        "(env changes, deterministic) after apply, apply, restore(second)",
        (r["nested_env"], r["on_nested"]),
        "([], True): the first policy still in force",
        "ds_determinism_restore (nested)",
    )
    check(
        not r["leaked_env"],
        "environment variables left changed",
        r["leaked_env"],
        "none",
        f"apply + restore {start}",
    )
    check(
        not r["settings"],
        "torch settings [before, after] apply + restore",
        r["settings"],
        "unchanged",
        f"ds_determinism_restore {start}",
    )


@capability("determinism")
@hooks("ds_determinism_apply")
@promise(
    "ds_determinism_apply", "two runs of the same program on the same device are bitwise equal"
)
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


#: intra-op threads for the order-sensitive check: on the host, index backward with colliding
#: indices then adds in parallel with atomics, so the summation order follows thread timing.
_THREADS = 4
_RUNS = 12
_N = 1 << 17


def _order_sensitive_step(acc: Any) -> list[torch.Tensor]:
    """One training step whose result depends on summation order without determinism.

    A gather from an 8-row table by 2^17 colliding indices: its backward scatters 2^17 rows
    of widely ranging magnitude (1e-6 .. 1e6) into 8 rows of the gradient. Devices add them
    with atomics (order = completion order) unless deterministic algorithms are on; torch's
    host kernel does the same with several threads. Every generator is seeded first.
    """
    _seed_all(acc, 0)
    device = acc.device()
    table = torch.nn.Parameter(torch.randn(8, 16, device=device))
    head = torch.nn.Linear(16, 1).to(device)  # initialised from the host generator
    idx = torch.randint(0, 8, (_N,), device=device)
    scale = torch.logspace(-6, 6, _N, device=device)[torch.randperm(_N, device=device)]
    src = torch.randn(_N, 16, device=device) * scale[:, None]
    opt = torch.optim.SGD([table, *head.parameters()], lr=1e-3)
    head(table[idx] * src).sum().backward()
    grad = table.grad.detach().cpu().clone() if table.grad is not None else torch.empty(0)
    opt.step()
    acc.synchronize()
    return [
        grad,
        table.detach().cpu().clone(),
        *(p.detach().cpu().clone() for p in head.parameters()),
    ]


@capability("determinism")
@hooks("ds_determinism_apply", "ds_determinism_restore")
@promise("determinism", "Opt-in deterministic execution.")
def test_order_sensitive_training_is_bitwise_repeatable(acc: Any) -> None:
    """Under the hook, twelve runs of an accumulation whose order is otherwise up to thread
    or atomic timing give one result, bit for bit. A hook that sets nothing fails this: the
    project's tests run it on such a backend (tests/broken_backends/determinism_noop.py)."""
    threads = torch.get_num_threads()
    record = acc.set_deterministic(True)
    try:
        torch.set_num_threads(_THREADS)
        runs = [_order_sensitive_step(acc) for _ in range(_RUNS)]
    finally:
        torch.set_num_threads(threads)
        acc.restore_determinism(record)
    distinct = {tuple(bytes(t.contiguous().view(torch.uint8).numpy()) for t in run) for run in runs}
    check(
        len(distinct) == 1,
        f"distinct results of {_RUNS} equal runs (gradient, parameters)",
        len(distinct),
        "1 (bitwise equal)",
        f"set_deterministic(True); index backward with colliding indices, {_THREADS} threads",
    )
