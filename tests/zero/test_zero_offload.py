"""Optimizer offload (``offload_optimizer.device = "cpu"``) at stages 1-3 on 2 gloo ranks.

Oracles: single-process PyTorch on the global batch (``check_against_reference``: fp32, 1e-5
relative, parameters with a 1e-5 × max-magnitude floor), and the same engine without offload
(within 5e-5, the issue's bound; in practice far closer). On the CPU backend host and device
are the same memory and ``pinned_memory`` is absent, so the copies are host to host and
unpinned, but every step of the offload path runs.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_core.errors import ConfigError
from ds_core.zero.config import load_config
from ds_core.zero.offload.host import OptimizerOffload
from ds_core.zero.partition import FlatUnit, Mode, ZeroParam
from tests.zero._offload import scenarios
from tests.zero.conftest import SuiteGetter, SuiteResults
from tests.zero.test_zero_stages import check_against_reference

OFFLOADED = [n for n, sc in scenarios().items() if sc.offload]
EQUAL = 5e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", OFFLOADED)
def test_offload_matches_single_process_reference(
    suite: SuiteGetter, backend: str, name: str
) -> None:
    check_against_reference(scenarios()[name], suite("offload", 2, backend).ranks(name))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 4])
def test_offload_equals_the_engine_without_it(
    suite: SuiteGetter, backend: str, stage: int, gas: int
) -> None:
    results = suite("offload", 2, backend)
    for on, off in zip(
        results.ranks(f"s{stage}_gas{gas}"), results.ranks(f"s{stage}_gas{gas}_plain"), strict=True
    ):
        torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]),
                                   rtol=EQUAL, atol=EQUAL)  # fmt: skip
        for pname, value in off["state"].items():
            torch.testing.assert_close(on["state"][pname], value, rtol=EQUAL, atol=EQUAL)
        assert on["optimizer"] == "DeepSpeedCPUAdam" and off["optimizer"] == "AdamW"


@pytest.mark.slow
def test_masters_and_state_live_on_the_host_and_are_accounted(
    suite: Callable[[str, int], SuiteResults],
) -> None:
    for name in ("s1_gas1", "s2_gas4", "s3_gas1"):
        for r in suite("offload", 2).ranks(name):
            assert r["master_devices"] == ["cpu"] and r["state_devices"] == ["cpu"]
            assert r["pinned"] is False  # the CPU backend declares pinned_memory absent
            b = r["bytes"]
            # fp32 model: the device keeps parameters and gradient ranges, nothing else.
            assert b["master"] == 0 and b["optimizer"] == 0
            assert b["host_master"] == b["host_grads"] > 0
            assert b["host_optimizer"] == 2 * b["host_master"]  # Adam's two fp32 moments
            assert b["host_staging"] == 0  # fp32 ranges go back from the master directly
            assert b["host_total"] == (
                b["host_master"] + b["host_grads"] + b["host_staging"] + b["host_optimizer"]
            )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s1_gas1", "s2_gas4", "s3_gas4", "s2_explicit", "s1_gas4"])
def test_the_host_accumulator_changes_after_every_micro_step(
    suite: Callable[[str, int], SuiteResults], name: str
) -> None:
    sc = scenarios()[name]
    for r in suite("offload", 2).ranks(name):
        sums = r["host_grad_sums"]
        if sc.stage == 1 and sc.gas > 1:
            # Stage 1 with accumulation reduces once per window, at the step: the device keeps
            # the full local accumulator and the host receives the window's range then.
            assert not r["host_accumulates"] and r["bytes"]["grads"] > 0
            continue
        assert r["host_accumulates"]
        assert r["bytes"]["grads"] == 0  # no gradient accumulator left on the device
        for window in range(len(sums) // sc.gas):
            seen = sums[window * sc.gas : (window + 1) * sc.gas]
            assert all(v > 0 for v in seen), seen  # zeroed at the start, then filled
            assert all(b != a for a, b in itertools.pairwise(seen)), seen


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_host_masters_keep_fp32_precision(
    suite: Callable[[str, int], SuiteResults], stage: int
) -> None:
    for r in suite("offload", 2).ranks(f"bf16_s{stage}"):
        plain, off = r["plain"], r["offload"]
        moved = 0
        for name, master in off["masters"].items():
            assert master.dtype == torch.float32 and master.device.type == "cpu"
            torch.testing.assert_close(master, plain["masters"][name], rtol=1e-6, atol=1e-7)
            # lr 1e-5: every update is below bf16's resolution near 1, so only an fp32 master
            # can hold it; the master moved while a bf16 copy of it would not have.
            moved += int((master != off["start"][name]).sum())
        assert moved > 0
        b = off["bytes"]
        # 16-bit model with offload: fp32 master and Adam state are host-only (12 bytes per
        # partitioned parameter, padding included), the device keeps none of them.
        assert b["master"] == 0 and b["optimizer"] == 0
        assert b["host_master"] + b["host_optimizer"] >= 12 * off["parts"]
        assert plain["bytes"]["master"] > 0 and plain["bytes"]["optimizer"] > 0
        assert b["host_staging"] > 0  # the bf16 staging buffer of the largest range


@pytest.mark.slow
def test_destroy_releases_every_host_buffer_of_20_engines(
    suite: Callable[[str, int], SuiteResults],
) -> None:
    for r in suite("offload", 2).ranks("teardown"):
        assert r["tracked"] > 0
        assert r["alive"] == [0] * 20


class _PinningAccelerator:
    """Stands in for an accelerator declaring ``pinned_memory`` and records its pinned
    allocations and frees. A CPU build of torch cannot page-lock, so its buffers are pageable,
    and filled with 7s (alloc_pinned's contents are unspecified); it has no ``pin_memory``, so
    a pinning copy would fail."""

    name = "pinning-stand-in"
    capabilities = frozenset({"pinned_memory"})

    def __init__(self) -> None:
        self.allocated: list[torch.Tensor] = []
        self.freed: list[torch.Tensor] = []

    def alloc_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.full(shape, 7, dtype=dtype)
        self.allocated.append(t)
        return t

    def free_pinned(self, t: torch.Tensor) -> bool:
        assert any(t is a for a in self.allocated) and not any(t is f for f in self.freed)
        t.untyped_storage().resize_(0)
        self.freed.append(t)
        return True


def _unit(part: int, values: torch.Tensor) -> Any:
    zp = SimpleNamespace(shard_offset=0, shard_numel=part, master=None)
    return SimpleNamespace(
        part=part, dtype=values.dtype, trainable=[zp], owned=lambda: values, host_shard=False
    )


def test_pinned_offload_allocates_its_buffers_pinned_and_frees_them_at_release() -> None:
    acc = _PinningAccelerator()
    offload = OptimizerOffload(acc, pin_memory=True)  # type: ignore[arg-type]
    small = _unit(3, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    large = _unit(5, torch.arange(5, dtype=torch.bfloat16))
    offload.make_masters([small, large])
    shapes = [(tuple(t.shape), t.dtype) for t in acc.allocated]
    f32, bf16 = torch.float32, torch.bfloat16
    # master, grad, staging per unit; the large unit's staging replaces the small one's
    assert shapes == [
        ((3,), f32),
        ((3,), f32),
        ((3,), bf16),
        ((5,), f32),
        ((5,), f32),
        ((5,), bf16),
    ]
    assert acc.freed == [acc.allocated[2]]  # the outgrown staging buffer, at once
    assert torch.equal(offload.buffer(large), torch.zeros(5))  # zeroed, not alloc's 7s
    assert torch.equal(large.trainable[0].master.detach(), torch.arange(5.0))
    offload.release()
    assert len(acc.freed) == 6 and all(t.untyped_storage().nbytes() == 0 for t in acc.allocated)
    assert large.trainable[0].master is None
    offload.release()  # a second teardown frees nothing twice
    assert len(acc.freed) == 6


def _zero(section: dict[str, object]) -> dict[str, object]:
    return {"train_batch_size": 2, "zero_optimization": section}


def test_config_accepts_deepspeed_offload_spellings() -> None:
    cfg = load_config(_zero({"stage": 2, "offload_optimizer": {"device": "cpu"}}), 1)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory  # DeepSpeed's default since #8207
    legacy = load_config(_zero({"stage": 1, "cpu_offload": True}), 1)
    assert legacy.zero_optimization.offload_optimizer.device == "cpu"
    assert not legacy.zero_optimization.offload_optimizer.pin_memory
    off = load_config(_zero({"stage": 1, "offload_optimizer": {"device": "none"}}), 1)
    assert off.zero_optimization.offload_optimizer.device == "none"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs stage 1, 2 or 3"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "'nvme' needs nvme_path"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}, "partial offload"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "'nvme' needs nvme_path"),
        ({"stage": 3, "cpu_offload_params": "yes"}, "cpu_offload_params must be true or false"),
    ],
)
def test_config_rejects_what_offload_does_not_do(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_zero(section), 1)


PARAM_OFFLOAD = ["s3_param", "s3_param_only", "s3_param_overlap"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PARAM_OFFLOAD)
def test_param_offload_matches_single_process_reference(
    suite: SuiteGetter, backend: str, name: str
) -> None:
    check_against_reference(scenarios()[name], suite("offload", 2, backend).ranks(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", PARAM_OFFLOAD)
def test_param_offload_keeps_stage3_shards_on_the_host(
    suite: Callable[[str, int], SuiteResults], name: str
) -> None:
    sc = scenarios()[name]
    for r in suite("offload", 2).ranks(name):
        assert r["host_shards"] and all(r["host_shards"])
        b = r["bytes"]
        # Every parameter of the tiny model is partitioned (threshold 0): the device keeps
        # no parameter storage; the host holds each rank's shards.
        assert b["params"] == 0 and b["host_params"] > 0
        if sc.offload:  # everything on the host: the device holds no model state at all
            assert b["master"] == b["optimizer"] == b["grads"] == 0
            # fp32 shards on the host are the masters' dtype on the masters' device: the
            # optimizer steps them in place, so no separate host master exists
            assert b["host_master"] == 0 and b["host_optimizer"] > 0
            assert b["host_total"] >= b["host_params"] + b["host_master"] + b["host_optimizer"]
        else:  # fp32 masters (separate device copies) and Adam state stay on the device
            # fp32 model: the masters are the trainable elements of the shards (which also
            # hold the frozen parameter and padding).
            assert 0 < b["master"] <= b["host_params"]
            assert b["optimizer"] == 2 * b["master"]
            assert r["optimizer"] == "AdamW"


def test_config_reads_deepspeed_param_offload_spellings() -> None:
    legacy = load_config(_zero({"stage": 3, "cpu_offload_params": True}), 1)
    assert legacy.zero_optimization.offload_param.device == "cpu"
    off = load_config(_zero({"stage": 2, "offload_param": {"device": "none"}}), 1)
    assert off.zero_optimization.offload_param.device == "none"
    knobs = {"device": "cpu", "buffer_count": 4, "buffer_size": 1e8, "max_in_cpu": 1e9}
    cfg = load_config(_zero({"stage": 3, "offload_param": knobs}), 1)
    assert cfg.zero_optimization.offload_param.pin_memory is True


class _GatheringStandIn(_PinningAccelerator):
    """The pinning stand-in plus a one-rank all-gather that records what it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.gather_inputs: list[torch.Tensor] = []

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
        self.gather_inputs.append(inp)
        out.copy_(inp)
        return SimpleNamespace(wait=lambda: None)

    def Event(self) -> Any:  # noqa: N802 - the facade's name
        log = self.events = getattr(self, "events", [])
        return SimpleNamespace(
            record=lambda: log.append("record"), synchronize=lambda: log.append("synchronize")
        )


def test_a_pinned_host_shard_is_gathered_through_a_device_copy_and_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    acc = _GatheringStandIn()
    monkeypatch.setattr("ds_core.zero.partition.get_accelerator", lambda: acc)
    weight = torch.nn.Parameter(torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    zp = ZeroParam("w", weight, Mode.PARTITIONED, None, 1, 0, None)
    unit = FlatUnit([zp], Mode.PARTITIONED, torch.device("cpu"), host_shard=True)
    assert unit.pinned and acc.allocated == [unit.shard]
    assert unit.shard is not None and (unit.shard.shape, unit.shard.dtype) == ((6,), torch.bfloat16)
    unit.place(zp, torch.arange(6, dtype=torch.float32).view(2, 3))
    sources: list[torch.Tensor] = []
    read = unit.storage.gather_source
    monkeypatch.setattr(
        unit.storage, "gather_source", lambda: sources.append(read()) or sources[-1]
    )
    unit.gather()
    # the gather reads a device copy of the host shard, never the host buffer itself (a group
    # of one copies it into the unit: no collective)
    (src,) = sources
    assert src.data_ptr() != unit.shard.data_ptr() and acc.gather_inputs == []
    assert torch.equal(weight.data, torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    unit.release()
    assert weight.numel() == 0
    # the step's write-back into the pinned shard is asynchronous: an event is recorded per
    # write and only a host read of the shard waits for it (no wait in the step itself)
    unit.write_owned(zp, torch.full((6,), 5.0))
    unit.write_owned(zp, torch.full((6,), 9.0))
    assert acc.events == ["record", "record"]
    assert torch.equal(unit.owned(), torch.full((6,), 9.0, dtype=torch.bfloat16))
    assert acc.events == ["record", "record", "synchronize"]
    unit.owned()  # nothing in flight any more
    assert acc.events[-1] == "synchronize" and len(acc.events) == 3
    shard = unit.shard
    unit.free()
    assert acc.freed == [shard] and shard.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_offload_below_stage_3_trains_as_without_it(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed ignores ``offload_param`` below stage 3; so does the engine: the same steps,
    bit for bit, and no parameter shard moves to the host (one process)."""
    import ds_core

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_core.reset_accelerator()

    def train(zero: dict[str, Any]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ignored-keys notice
            engine, _, _, _ = ds_core.initialize(model=model, config=cfg)
        try:
            assert not any(u.host_shard for u in engine.units), "a shard moved to the host"
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randn(4, 8, generator=gen)
                engine.backward(engine(x).square().mean())
                engine.step()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            engine.destroy()

    plain = train({"stage": stage})
    ignored = train({"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}})
    assert all(torch.equal(a, b) for a, b in zip(plain, ignored, strict=True))
    ds_core.reset_accelerator()
