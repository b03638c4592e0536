"""Contract tests of the Huawei Ascend backend (ds-core-npu) against a recorded fake of torch_npu.

No Ascend NPU here: these check the calls the backend makes into ``torch_npu`` and how it
translates the answers, not behaviour on hardware.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ds_backend_npu import plugin
from ds_backend_npu import probe as npu_probe

from ds_core.accelerator import build_accelerator
from ds_core.plugins import BackendEntry, choose, validate_backend
from ds_core.types import BackendInfo, ProbeResult
from tests.backends.fakes import fake_npu
from tests.backends.fakes.fake_device_module import FakeEvent, GiB
from tests.backends.fakes.fake_npu import FakeNpu, FakeNpuFusedAdamW
from tests.backends.helpers import (
    EMPTY_PINNED,
    PinCalls,
    check_pinned_buffers,
    probe_in_subprocess,
)

pytestmark = pytest.mark.contract

MakeFake = Callable[..., FakeNpu]


@pytest.fixture
def make_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeFake]:
    """Install a fresh fake torch_npu (keyword arguments as FakeNpu's)."""

    def make(**kwargs: Any) -> FakeNpu:
        fake = FakeNpu(**kwargs)
        fake_npu.install(monkeypatch, fake)
        return fake

    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    npu_probe.probe.clear()
    yield make
    npu_probe.probe.clear()


def _driver(monkeypatch: pytest.MonkeyPatch, found: int | None) -> None:
    """Make the probe see torch_npu installed and a driver reporting ``found`` NPUs."""
    answer = (found, "the Ascend driver (drvGetDevNum)") if found is not None else (None, "gone")
    monkeypatch.setattr(npu_probe, "module_present", lambda name: name == "torch_npu")
    monkeypatch.setattr(npu_probe, "hal_device_count", lambda: answer)
    npu_probe.probe.clear()


# --------------------------------------------------------------------------- probe


def test_probe_without_torch_npu_is_unavailable_and_imports_nothing() -> None:
    result = probe_in_subprocess("ds_backend_npu.plugin", ("torch_npu",))
    available, reason, count, imported, vendor = (
        result[key] for key in ("available", "reason", "device_count", "probe_imported", "vendor")
    )
    assert (available, count, imported, vendor) == (False, 0, [], [])
    assert reason.startswith('torch_npu is not installed; pip install "ds-core[npu]"')


def test_probe_counts_through_the_driver_under_the_visible_devices_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _driver(monkeypatch, 8)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count, result.imported) == (True, 4, ())
    assert "drvGetDevNum" in result.reason
    assert "torch_npu" not in sys.modules  # the probe never imports it
    npu_probe.probe.clear()


@pytest.mark.parametrize(
    ("mask", "visible"),
    [
        (None, 8),
        ("", 0),
        ("0,2", 2),
        ("2,1", 0),  # not ascending: torch_npu sees nothing
        ("0,1,9", 2),  # cut at the first id the driver lacks
        ("0,1,x,3", 2),  # reading stops at a character other than a digit or comma
        ("0,,3", 1),  # an empty entry ends the list
    ],
)
def test_visible_devices_follow_torch_npus_rules(
    monkeypatch: pytest.MonkeyPatch, mask: str | None, visible: int
) -> None:
    if mask is None:
        monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", mask)
    assert npu_probe.visible_count(8) == visible


def test_without_the_ascend_driver_library_the_probe_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found, why = npu_probe.hal_device_count()  # the real ctypes load: no driver on this host
    assert found is None and "libascend_hal.so" in why
    monkeypatch.setattr(npu_probe, "module_present", lambda name: True)
    npu_probe.probe.clear()
    reason = plugin.hooks.ds_backend_probe().reason
    assert reason.startswith("torch_npu is installed but the Ascend driver library")
    assert "npu-smi info" in reason
    npu_probe.probe.clear()


def test_a_device_less_torch_npu_never_wins_over_a_working_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _driver(monkeypatch, 0)
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count) == (False, 0)
    assert "reports 0 NPU(s), none" in result.reason
    gpu = SimpleNamespace(
        ds_backend_info=lambda: BackendInfo("gpu", "gpu", 100, 1),
        ds_backend_probe=lambda: ProbeResult(True, "1 GPU", 1),
    )
    entries = {
        "gpu": BackendEntry("gpu", "ds-core-gpu", "0.1.0", "gpu", plugin=gpu),
        "npu": BackendEntry(
            "npu", "ds-core-npu", "0.1.0", "ds_backend_npu.plugin:hooks", plugin=plugin.hooks
        ),
    }
    assert choose(None, entries).name == "gpu"
    npu_probe.probe.clear()


# --------------------------------------------------------------------------- registration


def test_registration_passes_with_determinism_and_npugraph(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    info, caps = validate_backend("npu", plugin.hooks)
    assert (info.name, info.device_type, info.priority) == ("npu", "npu", 100)
    assert caps == {
        "async_streams",
        "device_timing",
        "pinned_memory",
        "p2p",
        "determinism",
        "graph_capture",
    }
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: False)
    assert "graph_capture" not in validate_backend("npu", plugin.hooks)[1]


def test_npugraph_capture_behind_the_graph_protocol(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    acc = build_accelerator(
        BackendEntry(
            "npu", "ds-core-npu", "0.1.0", "ds_backend_npu.plugin:hooks", plugin=plugin.hooks
        )
    )
    acc.configure({"npu": {"graph_capture": True}})
    graph = acc.create_graph()
    other = acc.create_graph()
    side = fake.Stream(device="npu:0")
    with graph.capture(pool=other.pool(), stream=side):
        pass
    graph.replay()
    ctx = fake.called("graph")[-1]
    assert type(ctx[1][0]).__name__ == "NPUGraph"
    assert ctx[2] == {"pool": other.pool(), "stream": side}
    assert fake.names()[-1] == "Graph.replay"


# --------------------------------------------------------------------------- device, rng, streams


def test_device_rng_and_stream_hooks_use_npu_device_strings(make_fake: MakeFake) -> None:
    fake = make_fake()
    assert plugin.hooks.ds_device_count() == 8
    plugin.hooks.ds_device_set(3)
    plugin.hooks.ds_device_synchronize(2)
    plugin.hooks.ds_rng_get_state(5)
    plugin.hooks.ds_stream_create(1, -1)
    plugin.hooks.ds_stream_default(None)
    assert fake.called("set_device")[0][1] == (3,)
    assert fake.called("synchronize")[0][1] == ("npu:2",)
    assert fake.called("get_rng_state")[0][1] == ("npu:5",)
    assert fake.called("Stream")[0][2] == {"device": "npu:1", "priority": -1}
    assert fake.called("default_stream")[0][1] == ("npu",)
    props = plugin.hooks.ds_device_properties(None)
    assert (props.name, props.index) == ("Ascend910B2", 3)
    assert props.extra == {"cube_core_num": 24, "vector_core_num": 48, "L2_cache_size": 192 << 20}
    assert isinstance(plugin.hooks.ds_stream_event_create(True), FakeEvent)


# --------------------------------------------------------------------------- memory and dtypes


def test_memory_info_is_device_wide_without_a_fraction_getter(make_fake: MakeFake) -> None:
    fake = make_fake()
    info = plugin.hooks.ds_memory_info(1)
    assert (info.total, info.available, info.limit) == (64 * GiB, 61 * GiB, None)
    assert fake.called("mem_get_info")[0][1] == ("npu:1",)
    assert plugin.hooks.ds_memory_stats(None)["allocated_bytes.all.current"] == fake.allocated
    assert plugin.hooks.ds_memory_empty_cache() is True and fake.called("empty_cache")


def test_pinned_buffers_come_from_torch_empty_pinned_and_memory_is_not_self_throttled(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    acc = build_accelerator(
        BackendEntry(
            "npu", "ds-core-npu", "0.1.0", "ds_backend_npu.plugin:hooks", plugin=plugin.hooks
        )
    )
    check_pinned_buffers(acc, PinCalls(monkeypatch), EMPTY_PINNED)
    # DeepSpeed's NPU accelerator: handles_memory_backpressure() is is_synchronized_device().
    assert acc.handles_memory_backpressure() is False


def test_bf16_is_claimed_only_where_torch_npu_reports_it(make_fake: MakeFake) -> None:
    make_fake(bf16=False)
    dtypes = plugin.hooks.ds_dtype_supported()
    assert torch.float16 in dtypes and torch.bfloat16 not in dtypes
    assert torch.float64 not in dtypes
    assert not any(str(d).startswith("torch.float8") for d in dtypes)
    make_fake(bf16=True)
    assert torch.bfloat16 in plugin.hooks.ds_dtype_supported()


# --------------------------------------------------------------------------- comm and ops


def test_comm_is_hccl_registered_by_importing_torch_npu(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    imported: list[str] = []
    real_import = plugin.importlib.import_module
    monkeypatch.setattr(
        plugin.importlib, "import_module", lambda name: imported.append(name) or real_import(name)
    )
    assert plugin.hooks.ds_comm_backend_name() == "hccl"
    with pytest.raises(RuntimeError, match="importing torch_npu did not register it"):
        plugin.hooks.ds_comm_prepare()
    monkeypatch.setattr(dist.Backend, "backend_list", [*dist.Backend.backend_list, "hccl"])
    assert plugin.hooks.ds_comm_prepare() is True
    assert imported == ["torch_npu", "torch_npu"]


def test_fused_adam_is_npu_fused_adamw(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    (provider,) = plugin.hooks.ds_op_providers()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    assert provider.is_compatible() == (True, "torch_npu's NpuFusedAdamW")
    factory = provider.load()
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(factory(params, lr=0.01, amsgrad=True), FakeNpuFusedAdamW)
    assert FakeNpuFusedAdamW.built == [
        {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": True}
    ]
    with pytest.raises(ValueError, match="no AdamW option maximize=True"):
        factory(params, maximize=True)


# --------------------------------------------------------------------------- determinism, launcher


def test_determinism_sets_the_npu_level_and_hccl_and_restores_them(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake()
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    record = plugin.hooks.ds_determinism_apply(True)
    try:
        assert fake.level == 1 and torch.are_deterministic_algorithms_enabled()
        assert os.environ["HCCL_DETERMINISTIC"] == "true"
        assert torch.utils.deterministic.fill_uninitialized_memory is True
        assert record.env == {"HCCL_DETERMINISTIC": (None, "true")}
    finally:
        plugin.hooks.ds_determinism_restore(record)
    assert "HCCL_DETERMINISTIC" not in os.environ
    assert fake.called("set_deterministic_level")[-1][1] == (int(before),)
    monkeypatch.setenv("HCCL_DETERMINISTIC", "strict")
    record = plugin.hooks.ds_determinism_apply(True)
    assert os.environ["HCCL_DETERMINISTIC"] == "strict" and record.env == {}
    plugin.hooks.ds_determinism_restore(record)


def test_determinism_on_torch_npu_without_set_deterministic_level(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake(deterministic_level=False)
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    record = plugin.hooks.ds_determinism_apply(True)
    try:
        assert torch.are_deterministic_algorithms_enabled() is True
        assert not fake.called("set_deterministic_level")
    finally:
        plugin.hooks.ds_determinism_restore(record)
    assert torch.are_deterministic_algorithms_enabled() is before


def test_launcher_environment() -> None:
    assert plugin.hooks.ds_launcher_visible_devices_env() == ["ASCEND_RT_VISIBLE_DEVICES"]
    assert plugin.hooks.ds_launcher_env_prefixes() == ["ASCEND_", "HCCL_", "LD_LIBRARY", "PATH"]


# --------------------------------------------------------------------------- packaging


def test_distribution_pulls_torch_npu() -> None:
    dist = md.distribution("ds-core-npu")
    assert dist.requires == ["ds-core<0.2,>=0.1.0", "torch>=2.5", "torch-npu>=2.5"]
    assert [(e.group, e.name, e.value) for e in dist.entry_points] == [
        ("ds_core.backends", "npu", "ds_backend_npu.plugin:hooks")
    ]


def test_package_file_present_checks_installed_files_without_importing() -> None:
    from ds_core.backend_kit import package_file_present

    assert package_file_present("ds_backend_npu", "probe.py") is True
    assert package_file_present("ds_backend_npu", "no_such_module.py") is False
    assert package_file_present("torch_npu", "npu", "graphs.py") is False  # not installed
    assert "torch_npu" not in sys.modules
    with pytest.raises(ValueError, match="top-level name"):
        package_file_present("torch_npu.npu", "graphs.py")
