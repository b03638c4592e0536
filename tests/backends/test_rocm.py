"""Contract tests of the rocm backend against a recorded fake of a ROCm build's ``torch.cuda``.

A ROCm build keeps torch's CUDA-named API, so the fake is the ``torch.cuda`` fake with
``torch.version.hip`` set and ``gcnArchName`` in the device properties. Not hardware validation
(see backends/rocm/README.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ds_backend_cuda import plugin as cuda_plugin
from ds_backend_rocm import plugin

from ds_core.accelerator import build_accelerator
from ds_core.errors import DSCoreError
from ds_core.plugins import BackendEntry, validate_backend
from tests.backends.fakes.fake_cuda import FakeCuda, install
from tests.backends.fakes.fake_device_module import GiB
from tests.backends.helpers import (
    EMPTY_PINNED,
    PinCalls,
    check_pinned_buffers,
    probe_in_subprocess,
)

pytestmark = pytest.mark.contract

HIP = "6.4.43482"


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setattr(cuda_plugin, "KUNLUNXIN_DEVICE_NODES", str(tmp_path / "none" / "x[0-9]"))
    for p in (plugin, cuda_plugin):
        p.probe.clear()
    yield
    for p in (plugin, cuda_plugin):
        p.probe.clear()


@pytest.fixture
def amd(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """A ROCm build of torch with two MI300X GPUs."""
    fake = FakeCuda(2, arch="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X")
    return install(monkeypatch, fake, cuda=None, hip=HIP)


# --------------------------------------------------------------------------- probe


def test_probe_on_this_cpu_only_torch_is_unavailable_and_imports_nothing_vendor() -> None:
    result = probe_in_subprocess("ds_backend_rocm.plugin")
    assert result["available"] is False
    assert "not a ROCm build" in result["reason"] and "CPU-only build" in result["reason"]
    vendor = ("amdsmi", "torch_xmlir", "torch_npu", "habana_frameworks")
    assert not [m for m in result["imported"] if m.split(".")[0] in vendor]
    assert result["initialized"] is False


def test_a_cuda_build_is_left_to_the_cuda_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    install(monkeypatch, FakeCuda(2), cuda="12.8", hip=None)
    # an NVIDIA host: the driver's per-GPU device nodes, which the cuda probe counts
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for name in ("nvidia0", "nvidia1"):
        (nodes / name).touch()
    monkeypatch.setattr(cuda_plugin, "NVIDIA_DEVICE_NODES", str(nodes / "nvidia[0-9]*"))
    result = plugin.hooks.ds_backend_probe()
    assert not result.available
    assert "CUDA 12.8" in result.reason and "cuda backend" in result.reason
    assert cuda_plugin.hooks.ds_backend_probe().available


def test_a_rocm_host_is_claimed_by_rocm_alone(amd: FakeCuda) -> None:
    result = plugin.hooks.ds_backend_probe()
    assert result.available and result.device_count == 2
    assert HIP in result.reason
    # device_count() is amdsmi-first on ROCm builds; nothing else may be called.
    assert amd.names() == ["device_count"]
    assert not cuda_plugin.hooks.ds_backend_probe().available


def test_probe_with_no_gpu_names_the_masks(amd: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    amd.count = 0
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1")
    result = plugin.hooks.ds_backend_probe()
    assert not result.available
    assert "no AMD GPU" in result.reason
    assert "HIP_VISIBLE_DEVICES=''" in result.reason and "ROCR_VISIBLE_DEVICES='1'" in result.reason


def test_registration_validation_passes(amd: FakeCuda) -> None:
    info, declared = validate_backend("rocm", plugin.hooks)
    assert (info.name, info.device_type, info.vendor_version) == ("rocm", "cuda", HIP)
    assert {"async_streams", "device_timing", "pinned_memory", "graph_capture", "p2p"} <= declared


# --------------------------------------------------------------------------- hooks


def test_device_and_memory_hooks_use_cuda_device_strings(amd: FakeCuda) -> None:
    assert plugin.hooks.ds_device_count() == 2
    plugin.hooks.ds_device_set(1)
    plugin.hooks.ds_device_synchronize(1)
    assert amd.called("synchronize")[-1][1] == ("cuda:1",)
    props = plugin.hooks.ds_device_properties(0)
    assert props.extra["gcnArchName"] == "gfx942:sramecc+:xnack-"
    assert props.total_memory == 140 * GiB
    assert plugin.hooks.ds_memory_allocated(1) == 3 * GiB
    assert amd.called("memory_allocated")[-1][1] == ("cuda:1",)
    stream = plugin.hooks.ds_stream_create(None, 0)
    assert amd.called("Stream")[-1][2] == {"device": "cuda", "priority": 0}
    with plugin.hooks.ds_stream_use(stream):
        assert plugin.hooks.ds_stream_current(None) is stream


def test_memory_info_honours_the_per_process_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeCuda(1, arch="gfx90a", fraction=0.25), cuda=None, hip=HIP)
    info = plugin.hooks.ds_memory_info(0)
    assert info.total == info.limit == 35 * GiB
    assert info.available == 31 * GiB
    assert "set_per_process_memory_fraction(0.25)" in info.limit_source
    assert "memory_limits" in plugin.hooks.ds_backend_capabilities()


@pytest.mark.parametrize(
    ("arch", "fp8"),
    [("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx1201", True), ("gfx90a", False)],
)
def test_dtypes_follow_the_architecture(
    monkeypatch: pytest.MonkeyPatch, arch: str, fp8: bool
) -> None:
    fake = install(monkeypatch, FakeCuda(1, arch=arch, bf16=True), cuda=None, hip=HIP)
    dtypes = plugin.hooks.ds_dtype_supported()
    assert {torch.float32, torch.float16, torch.bfloat16, torch.float64} <= dtypes
    assert (torch.float8_e4m3fn in dtypes) is fp8
    assert fake.called("get_device_properties")


def test_bf16_follows_torch_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeCuda(1, arch="gfx906", bf16=False), cuda=None, hip=HIP)
    assert torch.bfloat16 not in plugin.hooks.ds_dtype_supported()


def test_pinned_buffers_come_from_torch_empty_pinned_and_memory_is_not_self_throttled(
    amd: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    acc = build_accelerator(
        BackendEntry(
            "rocm", "ds-core-rocm", "0.1.0", "ds_backend_rocm.plugin:hooks", plugin=plugin.hooks
        )
    )
    check_pinned_buffers(acc, PinCalls(monkeypatch), EMPTY_PINNED)
    # DeepSpeed's CUDA accelerator (which runs ROCm): handles_memory_backpressure() is
    # is_synchronized_device(), False on an asynchronous GPU.
    assert acc.handles_memory_backpressure() is False


def test_graph_is_a_hip_backed_cuda_graph_and_off_until_enabled_for_rocm(amd: FakeCuda) -> None:
    entry = BackendEntry(
        "rocm", "ds-core-rocm", "0.1.0", "ds_backend_rocm.plugin:hooks", plugin=plugin.hooks
    )
    acc = build_accelerator(entry)
    with pytest.raises(DSCoreError, match="graph capture is off"):
        acc.create_graph()
    acc.configure({"cuda": {"graph_capture": True}})  # another backend's section: still off
    with pytest.raises(DSCoreError, match="graph capture is off"):
        acc.create_graph()
    acc.configure({"rocm": {"graph_capture": True}})
    graph = acc.create_graph()
    with graph.capture(None, None):
        pass
    assert type(amd.called("graph")[0][1][0]).__name__ == "CUDAGraph"
    graph.replay()
    assert amd.names()[-1] == "Graph.replay"


def test_comm_is_nccl_over_rccl(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugin.hooks.ds_comm_backend_name() == "nccl"
    with pytest.raises(RuntimeError, match="RCCL"):
        plugin.hooks.ds_comm_prepare()
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert plugin.hooks.ds_comm_prepare() is True


def test_fused_adam_is_torch_fused_adamw() -> None:
    (provider,) = plugin.hooks.ds_op_providers()
    assert provider.name == "fused_adam" and provider.is_compatible()[0]
    assert provider.load().keywords == {"fused": True}


def test_determinism_record_restores(amd: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    record = plugin.hooks.ds_determinism_apply(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["NCCL_ALGO"] == "Ring"
        assert any("UNCONFIRMED" in n for n in record.notes)
    finally:
        plugin.hooks.ds_determinism_restore(record)
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic) == (
        before
    )
    assert "NCCL_ALGO" not in os.environ


def test_launcher_writes_hip_level_masks_only() -> None:
    envs = plugin.hooks.ds_launcher_visible_devices_env()
    assert envs == ["HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"]
    # ROCR renumbers before HIP; writing the same list into both would index the wrong set.
    assert "ROCR_VISIBLE_DEVICES" not in envs
    prefixes = plugin.hooks.ds_launcher_env_prefixes()
    assert {"NCCL_", "RCCL_", "HSA_", "MIOPEN_"} <= set(prefixes)
