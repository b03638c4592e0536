"""Contract tests of the cuda backend's selection and packaging against a recorded fake of
``torch.cuda`` (no GPU here): the probe (NVML, device nodes, masks, ROCm and Kunlunxin hosts), its
cache across fork, the wheels the core's extras pin, and ``ds-core report``. The hooks
themselves: test_cuda.py."""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_backend_cuda import plugin

from ds_core import hookimpl
from ds_core.plugins import validate_backend
from tests.backends.fakes import fake_xmlir
from tests.backends.fakes.fake_cuda import FakeCuda, install
from tests.backends.fakes.fake_device_module import GiB
from tests.backends.helpers import (
    accelerator_for,
    probe_in_subprocess,
)

pytestmark = [pytest.mark.contract, pytest.mark.usefixtures("fresh_cuda_probe")]

VENDOR_MODULES = ("torch_xmlir", "torch_npu", "habana_frameworks", "pynvml", "amdsmi")


# --------------------------------------------------------------------------- probe


def test_probe_on_this_cpu_only_torch_is_unavailable_and_imports_nothing_vendor() -> None:
    result = probe_in_subprocess("ds_backend_cuda.plugin", VENDOR_MODULES)
    assert result["available"] is False
    assert "built without CUDA" in str(result["reason"])
    assert "DS_ACCELERATOR=cpu" in str(result["reason"])
    imported = [str(m) for m in result["imported"]]
    assert not [m for m in imported if m.split(".")[0] in VENDOR_MODULES]
    assert result["initialized"] is False


def test_probe_counts_through_nvml_and_never_initialises_cuda(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an H200 (torch 2.11+cu130) torch.cuda.device_count() left NVML's thread running, and
    its fallback when NVML fails is cudaGetDeviceCount, which initialises the driver: the
    probe asks torch.cuda nothing, and cudaGetDeviceCount is never reached."""

    def initialises(*args: object) -> int:
        raise AssertionError("the probe called cudaGetDeviceCount, which runs cuInit")

    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", initialises, raising=False)
    result = plugin.hooks.ds_backend_probe()
    assert result.available and result.device_count == 2 and "NVML" in result.reason
    assert gpu.names() == []


@pytest.mark.parametrize(
    ("mask", "visible"),
    [(None, 4), ("", 0), ("-1", 0), ("1,3", 2), ("0,7,1", 1), ("GPU-0a1b,MIG-2c3d", 2), ("x", 0)],
)
def test_probe_applies_cuda_visible_devices_as_the_runtime_does(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch, mask: str | None, visible: int
) -> None:
    gpu.count = 4
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert plugin.hooks.ds_backend_probe().device_count == visible


def test_probe_counts_device_nodes_and_asks_nvml_only_without_them(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On an H200 (driver 580) nvmlInit started an OS thread that nvmlShutdown did not end:
    where the driver's per-GPU nodes exist, NVML is never called."""

    def nvml() -> tuple[int | None, str]:
        raise AssertionError("NVML called although /dev/nvidia<N> nodes exist")

    monkeypatch.setattr(plugin, "_nvml_device_count", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl"):
        (nodes / name).touch()
    monkeypatch.setattr(plugin, "NVIDIA_DEVICE_NODES", str(nodes / "nvidia[0-9]*"))
    result = plugin.hooks.ds_backend_probe()
    assert result.available and result.device_count == 3
    assert "nodes" in result.reason and gpu.names() == []

    plugin.probe.clear()
    for name in ("nvidia0", "nvidia1", "nvidia2"):
        (nodes / name).unlink()
    monkeypatch.setattr(plugin, "_nvml_device_count", lambda: (None, "nvmlInit_v2 failed"))
    result = plugin.hooks.ds_backend_probe()
    assert not result.available and "nvmlInit_v2 failed" in result.reason


def test_nvml_count_without_the_library_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "NVML_LIBRARY", "libno-such-nvml.so.1")
    found, why = plugin._nvml_device_count()
    assert found is None and "libno-such-nvml.so.1" in why


def test_probe_result_is_cached(gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plugin, "_nvml_device_count", lambda: calls.append(1) or (2, ""))
    plugin.hooks.ds_backend_probe()
    plugin.hooks.ds_backend_probe()
    assert calls == [1] and gpu.names() == []


def test_probe_steps_aside_for_a_rocm_build(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeCuda(2), cuda=None, hip="6.4.43482")
    result = plugin.hooks.ds_backend_probe()
    assert not result.available
    assert "ROCm build" in result.reason and "ds-core[rocm]" in result.reason


def test_probe_with_no_gpu_names_the_mask(gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu.count = 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = plugin.hooks.ds_backend_probe()
    assert not result.available
    assert "no NVIDIA GPU" in result.reason and "CUDA_VISIBLE_DEVICES=''" in result.reason


def test_probe_steps_aside_when_a_redirector_hijacks_torch_cuda(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu.contrib.transfer_to_npu", object())
    result = plugin.hooks.ds_backend_probe()
    assert not result.available and "transfer_to_npu" in result.reason


def test_probe_steps_aside_on_a_kunlunxin_host_without_importing_its_stack(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xmlir: None
) -> None:
    nodes = fake_xmlir.install_xmlir(monkeypatch, tmp_path, nodes=2)
    monkeypatch.setattr(plugin, "KUNLUNXIN_DEVICE_NODES", nodes)
    result = plugin.hooks.ds_backend_probe()
    assert not result.available
    assert "Kunlunxin" in result.reason and "ds-core[kunlunxin]" in result.reason
    assert fake_xmlir.IMPORTS == [] and "torch_xmlir" not in sys.modules
    assert gpu.names() == []


def test_a_device_less_kunlunxin_package_does_not_hide_a_working_gpu(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xmlir: None
) -> None:
    fake_xmlir.install_xmlir(monkeypatch, tmp_path, nodes=0)
    monkeypatch.setattr(plugin, "KUNLUNXIN_DEVICE_NODES", str(tmp_path / "dev" / "xpu[0-9]*"))
    nvidia = tmp_path / "nvdev"
    nvidia.mkdir()
    (nvidia / "nvidia0").touch()
    monkeypatch.setattr(plugin, "NVIDIA_DEVICE_NODES", str(nvidia / "nvidia[0-9]*"))
    assert plugin.hooks.ds_backend_probe().available

    plugin.probe.clear()
    (nvidia / "nvidia0").unlink()
    result = plugin.hooks.ds_backend_probe()
    assert not result.available and "no NVIDIA GPU device node" in result.reason


def test_registration_validation_passes(gpu: FakeCuda) -> None:
    info, declared = validate_backend("cuda", plugin.hooks)
    # Named like the module it replaced: the conformance suite's hygiene check reads __name__.
    assert plugin.hooks.__name__ == "ds_backend_cuda.plugin"
    assert (info.name, info.device_type, info.priority) == ("cuda", "cuda", 100)
    assert info.vendor_version == "12.8"
    assert declared == {
        "async_streams",
        "device_timing",
        "pinned_memory",
        "p2p",
        "determinism",
        "graph_capture",
    }


def test_memory_limits_are_declared_where_torch_exposes_the_fraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, FakeCuda(1, fraction=1.0))
    assert "memory_limits" in plugin.hooks.ds_backend_capabilities()


def test_the_facade_binds_an_instance_plugins_hooks_directly_and_through_a_wrapper(
    gpu: FakeCuda,
) -> None:
    acc: Any = accelerator_for(plugin.hooks, "cuda")
    # Inherited (kit) and own hooks alike bind to the instance's bound methods.
    assert acc.current_device == plugin.hooks.ds_device_current
    assert acc.current_device.__self__ is plugin.hooks
    assert acc.binding()["ds_memory_allocated"] == "direct"
    assert acc.memory_allocated(1) == 3 * GiB

    seen: list[int | None] = []

    class Tracer:
        @hookimpl(wrapper=True)
        def ds_memory_allocated(self, index: int | None) -> Generator[None, int, int]:
            seen.append(index)
            return (yield)

    acc._pm.register(Tracer())
    acc.rebind()
    assert acc.binding()["ds_memory_allocated"] == "pluggy"
    assert acc.memory_allocated(1) == 3 * GiB and seen == [1]
    assert gpu.called("memory_allocated")[-1][1] == ("cuda:1",)


# --------------------------------------------------------------------------- probe cache


def test_a_forked_child_probes_again(gpu: FakeCuda) -> None:
    assert plugin.hooks.ds_backend_probe().device_count == 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the cached answer belongs to the parent's process
        gpu.count = 5
        os.write(write, str(plugin.hooks.ds_backend_probe().device_count).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"5"
    os.close(read)
    assert plugin.hooks.ds_backend_probe().device_count == 2


# --------------------------------------------------------------------------- packaging


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cuda", "rocm", "kunlunxin"])
def test_the_backend_builds_as_the_wheel_the_core_extra_pins(name: str, tmp_path: Path) -> None:
    """Shared by the three torch.cuda-family backends: wheel, entry point, extra pin, data."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    build = ["pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", *build, str(root / "backends" / name)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob(f"ds_core_{name}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        files = set(archive.namelist())
        info = next(f.split("/")[0] for f in files if f.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    core = tomllib.loads((root / "pyproject.toml").read_text())
    extra = core["project"]["optional-dependencies"][name]
    assert extra == [f"{metadata['Name']}=={metadata['Version']}"]
    assert "[ds_core.backends]" in entry_points
    assert f"{name} = ds_backend_{name}.plugin:hooks" in entry_points
    for data in ("plugin.py", "py.typed", "conformance-xfail.txt"):
        assert f"ds_backend_{name}/{data}" in files


# --------------------------------------------------------------------------- report


def test_report_lists_the_installed_gpu_family_backends_as_unavailable_with_reasons() -> None:
    """On this CPU-only host with DS_ACCELERATOR unset: each one unavailable, selection refused."""
    installed = {ep.name for ep in md.entry_points(group="ds_core.backends")}
    mine = [n for n in ("cuda", "rocm", "kunlunxin") if n in installed]
    if not mine:
        pytest.skip("none of ds-core-cuda, ds-core-rocm, ds-core-kunlunxin is installed")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run(
        [sys.executable, "-m", "ds_core.cli", "report", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode != 0  # selection is refused, by design
    report = json.loads(out.stdout)
    rows = {row["name"]: row for row in report["backends"]}
    expected = {
        "cuda": "built without CUDA",
        "rocm": "not a ROCm build",
        "kunlunxin": "torch_xmlir",
    }
    for name in mine:
        assert rows[name]["installed"] and not rows[name]["available"]
        assert expected[name] in rows[name]["reason"]
        assert f"{name} (ds-core-{name} 0.1.0): " in report["selection_error"]
    assert "DS_ACCELERATOR=cpu" in report["selection_error"]
