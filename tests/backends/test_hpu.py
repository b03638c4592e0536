"""Contract tests of the Intel Gaudi backend (ds-core-hpu) against a recorded fake of the
``habana_frameworks.torch`` stack.

No Gaudi here: these check the calls the backend makes into the bridge and how it translates
the answers, not behaviour on hardware.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ds_backend_hpu import plugin
from ds_backend_hpu import probe as hpu_probe

from ds_core.accelerator import build_accelerator
from ds_core.errors import NotSupportedError
from ds_core.plugins import BackendEntry, validate_backend
from tests.backends.fakes import fake_hpu
from tests.backends.fakes.fake_device_module import GiB
from tests.backends.fakes.fake_hpu import FakeFusedAdamW, FakeHpu
from tests.backends.helpers import (
    PinCalls,
    check_pinned_buffers,
    probe_in_subprocess,
)

pytestmark = pytest.mark.contract

MakeFake = Callable[..., FakeHpu]


@pytest.fixture
def make_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeFake]:
    """Install a fresh fake Gaudi stack (keyword arguments as FakeHpu's)."""

    def make(**kwargs: Any) -> FakeHpu:
        fake = FakeHpu(**kwargs)
        fake_hpu.install(monkeypatch, fake)
        return fake

    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    monkeypatch.delenv("HABANA_VISIBLE_MODULES", raising=False)
    hpu_probe.probe.clear()
    yield make
    hpu_probe.probe.clear()


def _hl_smi(monkeypatch: pytest.MonkeyPatch, stdout: str, returncode: int = 0) -> list[list[str]]:
    """Make the probe see habana_frameworks and an hl-smi printing ``stdout``; return argvs."""
    argvs: list[list[str]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        argvs.append(argv)
        return subprocess.CompletedProcess(argv, returncode, stdout, "driver not loaded")

    monkeypatch.setattr(hpu_probe, "module_present", lambda name: name == "habana_frameworks")
    monkeypatch.setattr(hpu_probe.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(hpu_probe.subprocess, "run", run)
    hpu_probe.probe.clear()
    return argvs


# --------------------------------------------------------------------------- probe


def test_probe_without_habana_frameworks_is_unavailable_and_imports_nothing() -> None:
    result = probe_in_subprocess("ds_backend_hpu.plugin", ("habana_frameworks",))
    available, reason, count, imported, vendor = (
        result[key] for key in ("available", "reason", "device_count", "probe_imported", "vendor")
    )
    assert (available, count, imported, vendor) == (False, 0, [], [])
    assert reason.startswith("habana_frameworks is not installed")
    assert "not from pip" in reason and "docs.habana.ai" in reason


def test_probe_counts_modules_with_hl_smi_under_the_visible_modules_mask(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    argvs = _hl_smi(monkeypatch, "module_id\n0\n1\n2\n3\n")
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "2,3")
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count, result.imported) == (True, 2, ())
    assert argvs == [["/usr/bin/hl-smi", "-Q", "module_id", "-f", "csv"]]
    assert plugin.hooks.ds_backend_probe() is result and len(argvs) == 1  # cached


def test_probe_without_hl_smi_counts_habanalabs_driver_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hpu_probe, "module_present", lambda name: True)
    monkeypatch.setattr(hpu_probe.shutil, "which", lambda name: None)
    patterns: list[str] = []
    monkeypatch.setattr(hpu_probe, "count_device_nodes", lambda p: patterns.append(p) or 8)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1,2,3")
    hpu_probe.probe.clear()
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count) == (True, 4)
    assert patterns == ["/sys/bus/pci/drivers/habanalabs/[0-9a-f]*:*"]
    assert "hl-smi is not on PATH" in result.reason
    hpu_probe.probe.clear()


def test_an_installed_stack_without_gaudi_is_unavailable_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hl_smi(monkeypatch, "module_id\n")
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count) == (False, 0)
    assert "habana_frameworks is installed but hl-smi found no Gaudi module" in result.reason
    _hl_smi(monkeypatch, "", returncode=1)
    monkeypatch.setattr(hpu_probe, "count_device_nodes", lambda pattern: 0)
    reason = plugin.hooks.ds_backend_probe().reason
    assert "hl-smi exited 1: driver not loaded" in reason
    hpu_probe.probe.clear()


# --------------------------------------------------------------------------- registration


def test_registration_passes_and_graphs_need_lazy_mode(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    info, caps = validate_backend("hpu", plugin.hooks)
    assert (info.name, info.device_type, info.priority) == ("hpu", "hpu", 100)
    assert caps == {
        "async_streams",
        "device_timing",
        "pinned_memory",
        "p2p",
        "resolves_data_dependency",
        "handles_memory_backpressure",
    }
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert "graph_capture" in validate_backend("hpu", plugin.hooks)[1]


def test_execution_model_flags_are_deepspeeds_for_gaudi(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DeepSpeed's HPU accelerator: not synchronised, device timers, yet the runtime resolves
    # data dependencies and memory backpressure itself (F/F/T/T).
    make_fake()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    acc = _accelerator()
    flags = (
        acc.is_synchronized_device(),
        acc.use_host_timers(),
        acc.resolves_data_dependency(),
        acc.handles_memory_backpressure(),
    )
    assert flags == (False, False, True, True)


def _accelerator() -> Any:
    return build_accelerator(
        BackendEntry(
            "hpu", "ds-core-hpu", "0.1.0", "ds_backend_hpu.plugin:hooks", plugin=plugin.hooks
        )
    )


def test_hpu_graph_capture_in_lazy_mode_takes_a_stream_and_no_pool(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake(lazy=True)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    acc = _accelerator()
    acc.configure({"hpu": {"graph_capture": True}})
    graph = acc.create_graph()
    side = fake.Stream()
    with graph.capture(stream=side):
        pass
    graph.replay()
    (ctx,) = fake.called("graph")
    assert type(ctx[1][0]).__name__ == "HPUGraph" and ctx[2] == {"stream": side}
    assert fake.called("Graph.replay")
    with pytest.raises(ValueError, match="cannot share a memory pool"):
        graph.capture(pool=("pool", 1))
    assert graph.pool() is None


def test_eager_mode_refuses_graph_capture(make_fake: MakeFake) -> None:
    make_fake()
    with pytest.raises(NotSupportedError, match="graph_capture"):
        _accelerator().configure({"hpu": {"graph_capture": True}})


# --------------------------------------------------------------------------- device and rng


def test_synchronize_flushes_lazy_mode_then_waits_without_a_device(make_fake: MakeFake) -> None:
    fake = make_fake(lazy=True)
    plugin.hooks.ds_device_synchronize(None)
    assert fake.names()[-2:] == ["core.mark_step", "synchronize"]
    assert fake.called("synchronize") == [("synchronize", (), {})]
    eager = make_fake()
    plugin.hooks.ds_device_synchronize(0)
    assert "core.mark_step" not in eager.names()


def test_device_hooks(make_fake: MakeFake) -> None:
    fake = make_fake()
    assert plugin.hooks.ds_device_count() == 1
    assert plugin.hooks.ds_device_set(0) is True
    with pytest.raises(ValueError, match="out of range"):
        plugin.hooks.ds_device_set(1)
    props = plugin.hooks.ds_device_properties(None)
    assert (props.name, props.index, props.total_memory) == ("GAUDI2", 0, fake.limit)
    assert "sramBaseAddress" in props.extra["properties"]


def test_rng_goes_through_hpu_random_with_one_generator(make_fake: MakeFake) -> None:
    fake = make_fake()
    plugin.hooks.ds_rng_manual_seed(3, True)
    plugin.hooks.ds_rng_manual_seed(4, False)
    state = plugin.hooks.ds_rng_get_state(None)
    plugin.hooks.ds_rng_set_state(state, 0)
    assert [c[0] for c in fake.calls if c[0].startswith("random.")] == [
        "random.manual_seed_all",
        "random.manual_seed",
        "random.get_rng_state",
        "random.set_rng_state",
    ]
    assert fake.called("random.get_rng_state")[0][1] == ("hpu",)
    assert fake.called("random.set_rng_state")[0][1][1] == "hpu:0"
    assert plugin.hooks.ds_rng_default_generator(None) is fake.random.default_generators[0]
    # the bridge may count more modules than the one this process drives: index 1 is in range,
    # and still has no generator
    fake.count = 2
    with pytest.raises(ValueError, match="one Gaudi"):
        plugin.hooks.ds_rng_default_generator(1)


# --------------------------------------------------------------------------- streams and events


def test_events_flush_lazy_mode_before_recording_and_time_on_device(make_fake: MakeFake) -> None:
    fake = make_fake(lazy=True)
    fake.event_timing_ms = 2.5
    start, end = (
        plugin.hooks.ds_stream_event_create(True),
        plugin.hooks.ds_stream_event_create(True),
    )
    start.record()
    end.record()
    assert fake.names().count("core.mark_step") == 2
    assert fake.names().index("core.mark_step") < fake.names().index("Event.record")
    assert start.elapsed_time(end) == 2.5
    stream = plugin.hooks.ds_stream_create(None, 0)
    with plugin.hooks.ds_stream_use(stream):
        assert plugin.hooks.ds_stream_current(None) is stream
    assert plugin.hooks.ds_stream_default(None) is fake.default_stream()


# --------------------------------------------------------------------------- memory


def test_memory_comes_from_the_bridge_allocator_statistics(make_fake: MakeFake) -> None:
    fake = make_fake()
    stats = plugin.hooks.ds_memory_stats(None)
    assert stats["allocated_bytes.all.current"] == fake.allocated
    assert stats["allocated_bytes.all.peak"] == fake.allocated + GiB
    assert stats["reserved_bytes.all.current"] == fake.limit and stats["NumAllocs"] == 12
    info = plugin.hooks.ds_memory_info(None)
    assert (info.total, info.available, info.limit) == (
        fake.limit,
        fake.limit - fake.allocated,
        None,
    )
    assert plugin.hooks.ds_memory_reserved(None) == fake.limit


def test_memory_info_on_a_bridge_without_mem_get_info(make_fake: MakeFake) -> None:
    fake = make_fake(mem_get_info=False)
    info = plugin.hooks.ds_memory_info(0)
    assert (info.total, info.available) == (fake.limit, fake.limit - fake.allocated)
    assert not fake.called("mem_get_info")


def test_empty_cache_calls_the_bridge_where_it_has_one(make_fake: MakeFake) -> None:
    fake = make_fake()
    assert plugin.hooks.ds_memory_empty_cache() is True
    assert fake.called("empty_cache")


def test_pinning_names_the_hpu_device(make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch) -> None:
    make_fake()
    devices: list[Any] = []

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        devices.append(device)
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    t = torch.ones(2)
    assert plugin.hooks.ds_memory_pin(t) is t
    assert devices == [torch.device("hpu")]
    with pytest.raises(ValueError, match="host tensor"):
        plugin.hooks.ds_memory_pin(torch.ones(1, device="meta"))


def test_pinned_buffers_are_pinned_for_the_hpu_device(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    expected = [
        ("torch.empty", ((3, 5),), {"dtype": torch.float16, "device": "cpu"}),
        ("Tensor.pin_memory", ((3, 5),), {"device": torch.device("hpu")}),
    ]
    check_pinned_buffers(_accelerator(), PinCalls(monkeypatch), expected)


# --------------------------------------------------------------------------- dtypes


def test_dtypes_follow_the_bridge(make_fake: MakeFake) -> None:
    make_fake(fp16=False)
    dtypes = plugin.hooks.ds_dtype_supported()
    assert torch.bfloat16 in dtypes and torch.float16 not in dtypes
    assert torch.float64 not in dtypes
    assert not any(str(d).startswith("torch.float8") for d in dtypes)
    make_fake(fp16=True)
    assert torch.float16 in plugin.hooks.ds_dtype_supported()


# --------------------------------------------------------------------------- comm


def test_comm_is_hccl_after_importing_habanas_process_group(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    imported: list[str] = []
    real_import = plugin.importlib.import_module

    def record(name: str) -> Any:
        imported.append(name)
        return real_import(name)

    monkeypatch.setattr(plugin.importlib, "import_module", record)
    assert plugin.hooks.ds_comm_backend_name() == "hccl"
    with pytest.raises(RuntimeError, match="'hccl' is not available"):
        plugin.hooks.ds_comm_prepare()
    monkeypatch.setattr(dist.Backend, "backend_list", [*dist.Backend.backend_list, "hccl"])
    assert plugin.hooks.ds_comm_prepare() is True
    assert imported == ["habana_frameworks.torch.distributed.hccl"] * 2


# --------------------------------------------------------------------------- ops, determinism, launcher


def test_fused_adam_is_habanas_fused_adamw_with_adamw_defaults(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    (provider,) = plugin.hooks.ds_op_providers()
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: False)
    assert provider.is_compatible()[0] is False
    monkeypatch.setattr(plugin, "package_file_present", lambda *parts: True)
    ok, reason = provider.is_compatible()
    assert ok and "hpex.optimizers.FusedAdamW" in reason
    factory = provider.load()
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = factory(params, lr=0.1)
    assert isinstance(opt, FakeFusedAdamW)
    assert FakeFusedAdamW.built == [
        {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01}
    ]
    with pytest.raises(ValueError, match="no AdamW option amsgrad=True"):
        factory(params, amsgrad=True)


def test_determinism_applies_and_restores_both_torch_settings() -> None:
    det = torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory)
    record = plugin.hooks.ds_determinism_apply(True)
    try:
        assert torch.are_deterministic_algorithms_enabled() is True
        assert det.fill_uninitialized_memory is False
        assert any("HCCL" in n for n in record.notes)
    finally:
        plugin.hooks.ds_determinism_restore(record)
    assert (torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory) == before
    record = plugin.hooks.ds_determinism_apply(False)
    assert det.fill_uninitialized_memory is before[1]  # disabling leaves it alone
    plugin.hooks.ds_determinism_restore(record)


def test_launcher_environment() -> None:
    assert plugin.hooks.ds_launcher_visible_devices_env() == ["HABANA_VISIBLE_MODULES"]
    assert set(plugin.hooks.ds_launcher_env_prefixes()) == {"PT_HPU_", "HABANA_", "HCCL_"}


# --------------------------------------------------------------------------- packaging


def test_distribution_requires_no_gaudi_package() -> None:
    # The Gaudi stack comes from Intel's installers; nothing on PyPI provides it.
    dist = md.distribution("ds-core-hpu")
    assert dist.requires == ["ds-core<0.2,>=0.1.0", "torch>=2.5"]
    assert [(e.group, e.name, e.value) for e in dist.entry_points] == [
        ("ds_core.backends", "hpu", "ds_backend_hpu.plugin:hooks")
    ]
