"""The deterministic policy: what it sets, that it undoes all of it, and where it refuses."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import ds_core
from ds_core import NotSupportedError, determinism
from ds_core.zero.config import load_config


@pytest.fixture
def acc() -> Iterator[ds_core.Accelerator]:
    ds_core.reset_accelerator()
    ds_core.set_accelerator("cpu")
    yield ds_core.get_accelerator()
    ds_core.reset_accelerator()


def _torch_flags() -> dict[str, object]:
    b = torch.backends
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized": torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        "threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn.deterministic": b.cudnn.deterministic,
        "cudnn.benchmark": b.cudnn.benchmark,
        "mkldnn": b.mkldnn.enabled,
    }


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(4)


@pytest.mark.parametrize("warn_only", [None, False, True])
def test_enable_then_disable_leaves_flags_and_environment_as_they_were(
    acc: ds_core.Accelerator, warn_only: bool | None
) -> None:
    """Also from a state where deterministic algorithms were already on (warn-only or not):
    disabling returns to that state, it does not switch them off."""
    if warn_only is not None:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        env, flags = dict(os.environ), _torch_flags()
        policy = determinism.enable(3, acc)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert determinism.active() is policy
        policy.disable()
        assert dict(os.environ) == env and _torch_flags() == flags
        assert determinism.active() is None
    finally:
        torch.use_deterministic_algorithms(False)


def test_context_manager_nests_and_unwinds(acc: ds_core.Accelerator) -> None:
    flags = _torch_flags()
    with determinism.enable(1, acc) as outer:
        with determinism.enable(2, acc) as inner:
            assert determinism.active() is inner
            with pytest.raises(RuntimeError, match="disable it first"):
                outer.disable()
        assert determinism.active() is outer and torch.are_deterministic_algorithms_enabled()
    assert _torch_flags() == flags and not outer.active
    with pytest.raises(RuntimeError, match="already disabled"):
        outer.disable()


def test_seeds_every_generator(acc: ds_core.Accelerator) -> None:
    random.seed(100)
    np.random.seed(100)
    torch.manual_seed(100)
    with determinism.enable(5, acc):
        first = _draws()
        device_first = torch.rand(3, generator=acc.default_generator())
    random.seed(200)
    np.random.seed(200)
    torch.manual_seed(200)
    with determinism.enable(5, acc):
        second = _draws()
        device_second = torch.rand(3, generator=acc.default_generator())
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    assert torch.equal(device_first, device_second)
    with determinism.enable(6, acc):
        other = _draws()
    assert other[0] != first[0] and not torch.equal(other[2], first[2])


def test_record_lists_the_knobs(acc: ds_core.Accelerator) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with determinism.enable(9, acc) as policy:
        knobs = policy.knobs()
    assert knobs["torch.use_deterministic_algorithms"] == (before, True)
    # the backend hook's own record, under the backend's name
    assert knobs["cpu:torch.use_deterministic_algorithms"][1] is True
    for gen in ("python.random", "numpy.random", "torch.host", "cpu.device(all)"):
        assert knobs[f"seed:{gen}"] == 9
    assert policy.record.notes, "the cpu backend notes its thread-count caveat"


def test_backend_without_the_capability_is_refused_by_name(
    acc: ds_core.Accelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(acc, "_declared", acc._declared - {"determinism"})
    flags = _torch_flags()
    with pytest.raises(NotSupportedError) as info:
        determinism.enable(0, acc)
    assert info.value.backend == "cpu" and info.value.capability == "determinism"
    assert "backend 'cpu'" in str(info.value)
    assert _torch_flags() == flags and determinism.active() is None


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed_is_refused(acc: ds_core.Accelerator, seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        determinism.enable(seed, acc)  # type: ignore[arg-type]
    assert determinism.active() is None and not torch.are_deterministic_algorithms_enabled()


def test_config_section(acc: ds_core.Accelerator) -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    off = load_config(base, 1)
    assert off.deterministic.enabled is False and determinism.from_config(off.deterministic) is None
    cfg = load_config({**base, "deterministic": {"enabled": True, "seed": 4}}, 1)
    policy = determinism.from_config(cfg.deterministic, acc)
    assert policy is not None and policy.seed == 4
    policy.disable()
    with pytest.raises(ds_core.ConfigError, match=r"deterministic\.seed"):
        load_config({**base, "deterministic": {"enabled": True, "seed": -2}}, 1)
    with pytest.raises(ds_core.ConfigError, match="deterministic"):
        load_config({**base, "deterministic": {"enable": True}}, 1)
