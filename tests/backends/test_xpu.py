"""Contract tests of the Intel GPU backend (ds-core-xpu) against a recorded fake of torch.xpu.

No Intel GPU here: these check the calls the backend makes into ``torch.xpu`` and how it
translates the answers, not behaviour on hardware.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ds_backend_xpu import plugin
from ds_backend_xpu import probe as xpu_probe

from ds_core.accelerator import build_accelerator
from ds_core.errors import ConfigError, DSCoreError, NotSupportedError
from ds_core.plugins import BackendEntry, validate_backend
from tests.backends.fakes.fake_device_module import FakeEvent, GiB
from tests.backends.fakes.fake_xpu import FakeXpu
from tests.backends.helpers import (
    EMPTY_PINNED,
    PinCalls,
    check_pinned_buffers,
    probe_in_subprocess,
)

pytestmark = pytest.mark.contract

MakeFake = Callable[..., FakeXpu]


@pytest.fixture
def make_fake(monkeypatch: pytest.MonkeyPatch) -> MakeFake:
    """Install a fresh fake torch.xpu (keyword arguments as FakeXpu's) and reset caches."""

    def make(**kwargs: object) -> FakeXpu:
        fake = FakeXpu(**kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(torch, "xpu", fake)
        xpu_probe.probe.clear()
        monkeypatch.setattr(plugin, "_default_streams", {})
        return fake

    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    yield make  # type: ignore[misc]
    xpu_probe.probe.clear()


# --------------------------------------------------------------------------- probe


def test_probe_on_a_torch_without_xpu_is_unavailable_and_imports_nothing() -> None:
    result = probe_in_subprocess(
        "ds_backend_xpu.plugin",
        ("intel_extension_for_pytorch", "pyzes", "oneccl_bindings_for_pytorch"),
    )
    available, reason, count, imported, vendor = (
        result[key] for key in ("available", "reason", "device_count", "probe_imported", "vendor")
    )
    assert torch.xpu._is_compiled() is False  # this CI's torch is a CPU build
    assert (available, count, imported, vendor) == (False, 0, [], [])
    assert "was built without XPU support" in reason
    assert "download.pytorch.org/whl/xpu" in reason


def test_probe_counts_through_level_zero_sysman_when_pyzes_is_installed(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake(zes_count=4)
    monkeypatch.setattr(xpu_probe, "module_present", lambda name: name == "pyzes")
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count, result.imported) == (True, 4, ("pyzes",))
    assert "Level Zero Sysman" in result.reason
    assert plugin.hooks.ds_backend_probe() is result  # cached: Sysman is asked once
    assert fake.names() == ["_is_compiled", "_device_count_zes"]
    assert "device_count" not in fake.names()  # the SYCL count would initialise the runtime


def test_probe_without_sysman_counts_kernel_driver_nodes_under_the_affinity_mask(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake(zes_count=-1)
    nodes = {"/sys/bus/pci/drivers/i915/*:*": 1, "/sys/bus/pci/drivers/xe/*:*": 2}
    monkeypatch.setattr(xpu_probe, "count_device_nodes", nodes.__getitem__)
    monkeypatch.setattr(xpu_probe, "module_present", lambda name: False)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count, result.imported) == (True, 2, ())
    assert "i915/xe" in result.reason
    assert "_device_count_zes" not in fake.names()  # pyzes absent: Sysman is not tried


def test_an_xpu_torch_without_a_gpu_is_unavailable_with_the_reason(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake(zes_count=0)
    monkeypatch.setattr(xpu_probe, "module_present", lambda name: name == "pyzes")
    result = plugin.hooks.ds_backend_probe()
    assert (result.available, result.device_count) == (False, 0)
    assert (
        "Level Zero Sysman (pyzes) found no Intel GPU" in result.reason
        and "sycl-ls" in result.reason
    )


def test_ipex_on_a_cpu_torch_is_named_in_the_reason(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake(compiled=False)
    monkeypatch.setattr(
        xpu_probe, "module_present", lambda name: name == "intel_extension_for_pytorch"
    )
    reason = plugin.hooks.ds_backend_probe().reason
    assert "intel_extension_for_pytorch is installed" in reason


# --------------------------------------------------------------------------- registration


def test_registration_passes_and_capabilities_follow_the_torch_build(make_fake: MakeFake) -> None:
    make_fake(fraction=1.0)
    info, caps = validate_backend("xpu", plugin.hooks)
    assert (info.name, info.device_type, info.priority) == ("xpu", "xpu", 100)
    assert caps == {
        "async_streams",
        "device_timing",
        "pinned_memory",
        "p2p",
        "memory_limits",
        "graph_capture",
    }
    make_fake(graphs=False)
    _info, caps = validate_backend("xpu", plugin.hooks)
    assert "graph_capture" not in caps and "memory_limits" not in caps


def _accelerator() -> object:
    return build_accelerator(
        BackendEntry(
            "xpu", "ds-core-xpu", "0.1.0", "ds_backend_xpu.plugin:hooks", plugin=plugin.hooks
        )
    )


def test_graph_capture_goes_through_xpugraph_only_when_enabled(make_fake: MakeFake) -> None:
    fake = make_fake()
    acc = _accelerator()
    with pytest.raises(DSCoreError, match="graph capture is off on 'xpu'"):
        acc.create_graph()  # type: ignore[attr-defined]
    acc.configure({"xpu": {"graph_capture": True}})  # type: ignore[attr-defined]
    graph = acc.create_graph()  # type: ignore[attr-defined]
    side = fake.Stream(device="xpu:0")
    pool = ("pool", 7)
    with graph.capture(pool=pool, stream=side):
        pass
    graph.replay()
    graph.reset()
    (created,) = fake.called("Graph.__init__")
    assert created == ("Graph.__init__", (), {})
    (ctx,) = fake.called("graph")
    assert ctx[2] == {"pool": pool, "stream": side}
    assert type(ctx[1][0]).__name__ == "XPUGraph"
    assert fake.names()[-2:] == ["Graph.replay", "Graph.reset"]
    assert graph.pool() == ("pool", id(ctx[1][0]))


def test_a_torch_without_xpugraph_refuses_graph_capture(make_fake: MakeFake) -> None:
    make_fake(graphs=False)
    acc = _accelerator()
    with pytest.raises(NotSupportedError, match="graph_capture"):
        acc.configure({"xpu": {"graph_capture": True}})  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="unknown option"):
        acc.configure({"xpu": {"memory_fraction": 0.5}})  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- device and rng


def test_device_hooks_call_torch_xpu_with_device_strings(make_fake: MakeFake) -> None:
    fake = make_fake()
    assert plugin.hooks.ds_device_count() == 2
    assert plugin.hooks.ds_device_set(1) is True and fake.current == 1
    with pytest.raises(ValueError, match=r"torch\.xpu sees 2 device"):
        plugin.hooks.ds_device_set(2)
    plugin.hooks.ds_device_synchronize(0)
    assert fake.called("synchronize")[-1][1] == ("xpu:0",)
    props = plugin.hooks.ds_device_properties(None)
    assert (props.index, props.total_memory) == (1, 64 * GiB)
    assert props.extra["gpu_eu_count"] == 448 and props.extra["has_fp64"] is True


def test_rng_hooks(make_fake: MakeFake) -> None:
    fake = make_fake()
    plugin.hooks.ds_rng_manual_seed(7, True)
    plugin.hooks.ds_rng_manual_seed(8, False)
    state = plugin.hooks.ds_rng_get_state(1)
    plugin.hooks.ds_rng_set_state(state, None)
    assert fake.called("manual_seed_all")[0][1] == (7,)
    assert fake.called("manual_seed")[0][1] == (8,)
    assert fake.called("get_rng_state")[0][1] == ("xpu:1",)
    assert fake.called("set_rng_state")[0][1][1] == "xpu"
    assert plugin.hooks.ds_rng_default_generator(1) is fake.default_generators[1]


# --------------------------------------------------------------------------- streams and events


def test_default_stream_is_the_initial_stream_even_inside_a_stream_context(
    make_fake: MakeFake,
) -> None:
    fake = make_fake()
    side = plugin.hooks.ds_stream_create(1, -1)
    assert fake.called("Stream")[0][2] == {"device": "xpu:1", "priority": -1}
    initial = plugin.hooks.ds_stream_current(1)
    with plugin.hooks.ds_stream_use(side):
        assert plugin.hooks.ds_stream_current(1) is side
        assert plugin.hooks.ds_stream_default(1) is initial
    assert plugin.hooks.ds_stream_default(1) is initial
    assert fake.called("stream")[0][1] == (side,)


def test_events_are_device_timed(make_fake: MakeFake) -> None:
    fake = make_fake()
    event = plugin.hooks.ds_stream_event_create(True)
    assert isinstance(event, FakeEvent)  # not wrapped in host timers: XPU events time on device
    assert fake.called("Event")[0][2] == {"enable_timing": True}


# --------------------------------------------------------------------------- memory


def test_memory_info_is_capped_by_the_process_fraction(make_fake: MakeFake) -> None:
    fake = make_fake(fraction=0.25)
    info = plugin.hooks.ds_memory_info(0)
    assert info.total == 16 * GiB and info.limit == 16 * GiB
    assert info.available == 16 * GiB - fake.reserved
    assert "set_per_process_memory_fraction(0.25)" in info.limit_source
    assert fake.called("mem_get_info")[0][1] == ("xpu:0",)


def test_memory_stats_before_runtime_init_still_carry_the_contract_keys(
    make_fake: MakeFake,
) -> None:
    fake = make_fake(initialised=False)
    stats = plugin.hooks.ds_memory_stats(None)
    assert stats["allocated_bytes.all.current"] == fake.allocated
    assert stats["allocated_bytes.all.peak"] == fake.allocated + GiB


def test_memory_counters_and_pinning(make_fake: MakeFake) -> None:
    fake = make_fake()
    assert plugin.hooks.ds_memory_allocated(1) == fake.allocated
    assert plugin.hooks.ds_memory_reserved(1) == fake.reserved
    assert plugin.hooks.ds_memory_reset_peak(1) is True
    assert plugin.hooks.ds_memory_empty_cache() is True
    assert fake.called("reset_peak_memory_stats")[0][1] == ("xpu:1",)
    with pytest.raises(ValueError, match="host tensor"):
        plugin.hooks.ds_memory_pin(torch.zeros(1, device="meta"))


def test_pinned_buffers_come_from_torch_empty_pinned_and_memory_is_not_self_throttled(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    acc: Any = _accelerator()
    check_pinned_buffers(acc, PinCalls(monkeypatch), EMPTY_PINNED)
    # DeepSpeed's XPU accelerator: handles_memory_backpressure() is is_synchronized_device().
    assert acc.handles_memory_backpressure() is False


# --------------------------------------------------------------------------- dtypes


def test_bf16_is_claimed_only_with_native_conversions(make_fake: MakeFake) -> None:
    make_fake(native_bf16=False, fp64=False)
    dtypes = plugin.hooks.ds_dtype_supported()
    assert torch.float16 in dtypes
    assert torch.bfloat16 not in dtypes and torch.float64 not in dtypes
    assert not any(str(d).startswith("torch.float8") for d in dtypes)
    make_fake()
    assert {torch.bfloat16, torch.float64} <= plugin.hooks.ds_dtype_supported()


# --------------------------------------------------------------------------- comm


def test_comm_uses_xccl_where_torch_has_it(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True)
    assert plugin.hooks.ds_comm_backend_name() == "xccl"
    assert plugin.hooks.ds_comm_prepare() is True


def test_comm_falls_back_to_legacy_ccl_by_importing_the_oneccl_bindings(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    imported: list[str] = []
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    monkeypatch.setattr(plugin, "module_present", lambda name: name == plugin.ONECCL_MODULE)
    monkeypatch.setattr(plugin.importlib, "import_module", lambda name: imported.append(name))
    assert plugin.hooks.ds_comm_backend_name() == "ccl"
    monkeypatch.setattr(dist.Backend, "backend_list", [*dist.Backend.backend_list, "ccl"])
    assert plugin.hooks.ds_comm_prepare() is True
    assert imported == ["oneccl_bindings_for_pytorch"]


def test_comm_prepare_without_xccl_or_ccl_says_what_to_install(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake()
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False)
    monkeypatch.setattr(plugin, "module_present", lambda name: False)
    assert plugin.hooks.ds_comm_backend_name() == "xccl"
    with pytest.raises(RuntimeError, match=r"torch >= 2.8"):
        plugin.hooks.ds_comm_prepare()


# --------------------------------------------------------------------------- ops, determinism, launcher


def test_fused_adam_is_torch_fused_adamw_on_xpu(make_fake: MakeFake) -> None:
    make_fake()
    (provider,) = plugin.hooks.ds_op_providers()
    ok, reason = provider.is_compatible()
    assert (provider.name, ok) == ("fused_adam", True), reason
    factory = provider.load()
    assert factory.func is torch.optim.AdamW and factory.keywords == {"fused": True}


def test_determinism_sets_torch_flag_and_restores_it() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    record = plugin.hooks.ds_determinism_apply(True)
    try:
        assert torch.are_deterministic_algorithms_enabled() is True
        assert any("UNCONFIRMED" in n for n in record.notes)
    finally:
        plugin.hooks.ds_determinism_restore(record)
    assert torch.are_deterministic_algorithms_enabled() is before


def test_launcher_environment(make_fake: MakeFake) -> None:
    make_fake()
    assert plugin.hooks.ds_launcher_visible_devices_env() == ["ZE_AFFINITY_MASK"]
    assert {"ZE_", "CCL_"} <= set(plugin.hooks.ds_launcher_env_prefixes())


# --------------------------------------------------------------------------- packaging


def test_distribution_requires_no_vendor_stack_and_offers_ipex_as_an_extra() -> None:
    dist = md.distribution("ds-core-xpu")
    assert dist.requires == [
        "ds-core<0.2,>=0.1.0",
        "torch>=2.5",
        'intel-extension-for-pytorch; extra == "ipex"',
        'pyzes; extra == "sysman"',
    ]
    assert [(e.group, e.name, e.value) for e in dist.entry_points] == [
        ("ds_core.backends", "xpu", "ds_backend_xpu.plugin:hooks")
    ]
