"""Fixtures of the cuda backend's contract tests (test_cuda.py, test_cuda_probe.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends.fakes import fake_xmlir
from tests.backends.fakes.fake_cuda import FakeCuda, install


@pytest.fixture
def fresh_cuda_probe() -> Iterator[None]:
    """The cuda backend's cached probe, cleared before and after the test."""
    from ds_backend_cuda import plugin

    plugin.probe.clear()
    yield
    plugin.probe.clear()


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeCuda:
    """An NVIDIA host: a CUDA build of torch with two GPUs, no Kunlunxin device nodes."""
    from ds_backend_cuda import plugin

    monkeypatch.setattr(plugin, "KUNLUNXIN_DEVICE_NODES", str(tmp_path / "none" / "xpu[0-9]*"))
    fake = install(monkeypatch, FakeCuda(2))
    # No /dev/nvidia<N> node, so NVML answers, with the fake's count (read at each probe).
    monkeypatch.setattr(plugin, "NVIDIA_DEVICE_NODES", str(tmp_path / "nodes" / "nvidia[0-9]*"))
    monkeypatch.setattr(plugin, "_nvml_device_count", lambda: (fake.count, ""))
    return fake


@pytest.fixture
def xmlir() -> Iterator[None]:
    """The fake Kunlunxin stack forgotten after the test."""
    yield from fake_xmlir.forget_xmlir()
