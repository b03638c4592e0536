"""Contract tests of the kunlunxin backend against recorded fakes of Kunlunxin's stack.

The fakes: a ``torch_xmlir`` package findable on ``sys.path`` (its imports recorded), stand-ins
for the driver's ``/dev/xpuN`` nodes, Kunlunxin's CUDA-compatible ``torch.cuda``, and the fused
AdamW op ``torch.ops.custom_ops.optimizer_AdamW``. Not hardware validation (see
backends/kunlunxin/README.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ds_backend_cuda import plugin as cuda_plugin
from ds_backend_kunlunxin import fused_adam, plugin

from ds_core.accelerator import build_accelerator
from ds_core.backend_kit import HostTimedEvent
from ds_core.errors import NotSupportedError
from ds_core.plugins import BackendEntry, validate_backend
from tests.backends.fakes import fake_xmlir
from tests.backends.fakes.fake_cuda import FakeCuda, install
from tests.backends.fakes.fake_device_module import GiB
from tests.backends.helpers import (
    EMPTY_PINNED,
    PinCalls,
    check_pinned_buffers,
    probe_in_subprocess,
)

pytestmark = pytest.mark.contract


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("XPU_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", plugin.GRAPH_ENV):
        monkeypatch.delenv(var, raising=False)
    for p in (plugin, cuda_plugin):
        p.probe.clear()
    yield from fake_xmlir.forget_xmlir()
    for p in (plugin, cuda_plugin):
        p.probe.clear()


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeCuda:
    """A Kunlunxin host: torch_xmlir installed, four XPUs, torch.cuda in compatibility mode."""
    nodes = fake_xmlir.install_xmlir(monkeypatch, tmp_path, nodes=4)
    monkeypatch.setattr(plugin, "DEVICE_NODES", nodes)
    monkeypatch.setattr(cuda_plugin, "KUNLUNXIN_DEVICE_NODES", nodes)
    fake = FakeCuda(4, capability=(8, 0), bf16=True, name="Kunlun3 P800")
    return install(monkeypatch, fake, cuda="11.8", hip=None)


def accelerator() -> object:
    entry = BackendEntry("kunlunxin", "ds-core-kunlunxin", "0.1.0", "x", plugin=plugin.hooks)
    return build_accelerator(entry)


# --------------------------------------------------------------------------- probe


def test_probe_without_the_stack_says_where_it_comes_from_and_imports_nothing() -> None:
    result = probe_in_subprocess("ds_backend_kunlunxin.plugin")
    assert result["available"] is False
    assert "torch_xmlir" in result["reason"] and "not installed" in result["reason"]
    assert "does not come from PyPI" in result["reason"]
    vendor = ("torch_xmlir", "kunlun_ops", "xtorch_ops", "torch_npu", "habana_frameworks")
    assert not [m for m in result["imported"] if m.split(".")[0] in vendor]
    assert result["initialized"] is False


def test_a_kunlunxin_host_is_claimed_by_kunlunxin_alone_without_importing_the_stack(
    host: FakeCuda,
) -> None:
    result = plugin.hooks.ds_backend_probe()
    assert result.available and result.device_count == 4
    assert "CUDA-compatibility mode" in result.reason
    assert not cuda_plugin.hooks.ds_backend_probe().available
    assert fake_xmlir.IMPORTS == [] and "torch_xmlir" not in sys.modules
    assert host.names() == []  # the probe asked the device nodes, not torch.cuda


def test_a_plain_cuda_host_is_not_kunlunxin(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeCuda(2), cuda="12.8")
    result = plugin.hooks.ds_backend_probe()
    assert not result.available and "not installed" in result.reason


def test_the_stack_without_devices_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    nodes = fake_xmlir.install_xmlir(monkeypatch, tmp_path, nodes=0)
    monkeypatch.setattr(plugin, "DEVICE_NODES", nodes)
    result = plugin.hooks.ds_backend_probe()
    assert not result.available
    assert "no Kunlunxin device" in result.reason and "xpu-smi" in result.reason


def test_visible_devices_narrow_and_hide(host: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "0,1")
    assert plugin.hooks.ds_backend_probe().device_count == 2
    plugin.probe.clear()
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "")
    result = plugin.hooks.ds_backend_probe()
    assert not result.available and "hidden by XPU_VISIBLE_DEVICES=''" in result.reason


def test_registration_validation_passes(host: FakeCuda) -> None:
    info, declared = validate_backend("kunlunxin", plugin.hooks)
    assert (info.name, info.device_type, info.priority) == ("kunlunxin", "cuda", 100)
    assert "determinism" not in declared and "memory_limits" not in declared


# --------------------------------------------------------------------------- activation, device


def test_the_first_device_call_imports_torch_xmlir_once(host: FakeCuda) -> None:
    assert plugin.hooks.ds_device_count() == 4
    assert fake_xmlir.IMPORTS == ["torch_xmlir"]
    plugin.hooks.ds_device_set(3)
    plugin.hooks.ds_device_synchronize(None)
    assert fake_xmlir.IMPORTS == ["torch_xmlir"]
    assert host.called("set_device") == [("set_device", (3,), {})]
    assert host.called("synchronize")[-1][1] == ("cuda",)
    plugin.hooks.ds_rng_get_state(2)
    assert host.called("get_rng_state")[-1][1] == ("cuda:2",)


def test_memory_info_is_device_wide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_xmlir.install_xmlir(monkeypatch, tmp_path, nodes=1)
    # Even if torch exposes a fraction getter, no Kunlunxin limit is claimed.
    fake = install(monkeypatch, FakeCuda(1, fraction=0.5), cuda="11.8")
    info = plugin.hooks.ds_memory_info(0)
    assert (info.total, info.available, info.limit) == (140 * GiB, 100 * GiB, None)
    assert fake.called("mem_get_info") == [("mem_get_info", ("cuda:0",), {})]
    assert fake.called("get_per_process_memory_fraction") == []


def test_pinned_buffers_come_from_torch_empty_pinned_and_memory_is_not_self_throttled(
    host: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.empty(pin_memory=True) through torch.cuda, as Kunlunxin's ds_memory_pin pins
    # (UNCONFIRMED on hardware that it page-locks there, as for pin_memory).
    acc: Any = accelerator()
    check_pinned_buffers(acc, PinCalls(monkeypatch), EMPTY_PINNED)
    assert acc.handles_memory_backpressure() is False


# --------------------------------------------------------------------------- events


def test_events_are_host_timed_while_device_events_are_stubs(
    host: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin.hooks, "host_timers", True)
    assert "device_timing" not in plugin.hooks.ds_backend_capabilities()
    stream = plugin.hooks.ds_stream_create(0, 0)
    start = plugin.hooks.ds_stream_event_create(True)
    end = plugin.hooks.ds_stream_event_create(True)
    assert isinstance(start, HostTimedEvent)
    start.record(stream)
    time.sleep(0.02)
    end.record(stream)
    # The vendor's own elapsed_time answers 0.0; the host clock sees the 20 ms.
    assert start.event.elapsed_time(end.event) == 0.0
    assert start.elapsed_time(end) >= 15.0
    assert host.names().count("Stream.synchronize") == 2
    assert host.called("Event.record")[0][1] == (stream,)
    unrecorded = plugin.hooks.ds_stream_event_create(True)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(unrecorded)


def test_real_device_events_are_used_when_enabled(
    host: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin.hooks, "host_timers", False)
    assert "device_timing" in plugin.hooks.ds_backend_capabilities()
    assert not isinstance(plugin.hooks.ds_stream_event_create(True), HostTimedEvent)


def test_host_timers_follow_the_vendor_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.DUMMY_EVENT_ENV, raising=False)
    monkeypatch.setenv(plugin.EVENT_ENV, "1")
    assert plugin._device_events_real()
    monkeypatch.setenv(plugin.DUMMY_EVENT_ENV, "1")
    assert not plugin._device_events_real()
    monkeypatch.delenv(plugin.EVENT_ENV)
    monkeypatch.delenv(plugin.DUMMY_EVENT_ENV)
    assert not plugin._device_events_real()


# --------------------------------------------------------------------------- dtypes, graphs


def test_dtypes_claim_no_fp64_or_fp8(host: FakeCuda) -> None:
    dtypes = plugin.hooks.ds_dtype_supported()
    assert {torch.float32, torch.float16, torch.bfloat16} <= dtypes
    assert torch.float64 not in dtypes and torch.float8_e4m3fn not in dtypes
    # Called with torch's default (emulation included), which tries bf16 on the device itself.
    assert host.called("is_bf16_supported") == [
        ("is_bf16_supported", (), {"including_emulation": True})
    ]
    host.bf16 = False
    assert torch.bfloat16 not in plugin.hooks.ds_dtype_supported()


def test_graph_capture_is_absent_without_the_vendor_switch(host: FakeCuda) -> None:
    assert "graph_capture" not in plugin.hooks.ds_backend_capabilities()
    acc = accelerator()
    with pytest.raises(NotSupportedError, match="graph_capture"):
        acc.configure({"kunlunxin": {"graph_capture": True}})  # type: ignore[attr-defined]


def test_graph_capture_uses_cuda_graph_under_the_vendor_switch(
    host: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugin.GRAPH_ENV, "1")
    assert "graph_capture" in plugin.hooks.ds_backend_capabilities()
    acc = accelerator()
    acc.configure({"kunlunxin": {"graph_capture": True}})  # type: ignore[attr-defined]
    graph = acc.create_graph()  # type: ignore[attr-defined]
    with graph.capture(None, None):
        pass
    assert type(host.called("graph")[0][1][0]).__name__ == "CUDAGraph"
    assert fake_xmlir.IMPORTS == ["torch_xmlir"]


# --------------------------------------------------------------------------- comm


def test_comm_prepare_imports_the_stack_then_checks_nccl(
    host: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert plugin.hooks.ds_comm_backend_name() == "nccl"
    with pytest.raises(RuntimeError, match="BKCL"):
        plugin.hooks.ds_comm_prepare()
    assert fake_xmlir.IMPORTS == ["torch_xmlir"]
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert plugin.hooks.ds_comm_prepare() is True


# --------------------------------------------------------------------------- fused adam


def test_fused_adam_needs_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, reason = fused_adam.PROVIDER.is_compatible()
    assert not ok and "torch_xmlir is not installed" in reason


def test_fused_adam_steps_through_the_kunlunxin_kernel_like_adamw(host: FakeCuda) -> None:
    calls = fake_xmlir.register_adamw_kernel()
    ok, reason = fused_adam.PROVIDER.is_compatible()
    assert ok and "looked up on load" in reason  # torch_xmlir not imported yet
    optimizer_class = fused_adam.PROVIDER.load()
    assert optimizer_class is fused_adam.FusedAdamW
    assert fused_adam.PROVIDER.is_compatible() == (
        True,
        "Kunlunxin fused kernel torch.ops.custom_ops.optimizer_AdamW",
    )

    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    fused = optimizer_class(params, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    plain = torch.optim.AdamW(reference, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for _ in range(3):
        for group in (params, reference):
            loss = sum((p * torch.arange(p.numel()).view_as(p)).square().sum() for p in group)
            loss.backward()  # type: ignore[union-attr]
        fused.step()
        plain.step()
        fused.zero_grad()
        plain.zero_grad()
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 6
    numel, lr, beta1_pow, beta2_pow, beta1, beta2, eps, wd = calls[-1]
    assert (numel, lr, beta1, beta2, eps, wd) == (7, pytest.approx(0.01), 0.8, 0.95, 1e-6, 0.1)
    assert (beta1_pow, beta2_pow) == (pytest.approx(0.8**3), pytest.approx(0.95**3))


def test_fused_adam_refuses_what_the_kernel_lacks() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        fused_adam.FusedAdamW([torch.zeros(1, requires_grad=True)], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        fused_adam.FusedAdamW([torch.zeros(1, requires_grad=True)], betas=(1.0, 0.9))


# --------------------------------------------------------------------------- determinism, launcher


def test_determinism_switches_torch_only_and_says_so(host: FakeCuda) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    record = plugin.hooks.ds_determinism_apply(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert list(record.settings) == ["torch.use_deterministic_algorithms"]
        assert record.env == {}
        assert any("no Kunlunxin determinism knob" in n for n in record.notes)
    finally:
        plugin.hooks.ds_determinism_restore(record)
    assert torch.are_deterministic_algorithms_enabled() is before


def test_launcher_environment() -> None:
    assert plugin.hooks.ds_launcher_visible_devices_env() == [
        "XPU_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
    ]
    assert {"BKCL_", "XPU_", "XMLIR_"} <= set(plugin.hooks.ds_launcher_env_prefixes())
