"""Contract tests of the cuda backend against a recorded fake of ``torch.cuda`` (no GPU here).

They prove the backend makes the documented ``torch.cuda`` calls with the right arguments and
translates the answers; they are not hardware validation (see backends/cuda/README.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ds_backend_cuda import plugin

from ds_core.backend_kit import (
    DeterminismPolicy,
    TorchStyleGraph,
    dist_version,
    module_present,
    visible_device_count,
)
from ds_core.errors import DSCoreError, NotSupportedError
from ds_core.types import DeterminismRecord
from tests.backends.fakes.fake_cuda import FakeCuda, install
from tests.backends.fakes.fake_device_module import GiB
from tests.backends.helpers import (
    EMPTY_PINNED,
    PinCalls,
    accelerator_for,
    check_pinned_buffers,
)

pytestmark = [pytest.mark.contract, pytest.mark.usefixtures("fresh_cuda_probe")]

VENDOR_MODULES = ("torch_xmlir", "torch_npu", "habana_frameworks", "pynvml", "amdsmi")


# --------------------------------------------------------------------------- device, rng


def test_device_hooks_use_cuda_device_strings(gpu: FakeCuda) -> None:
    assert plugin.hooks.ds_device_count() == 2
    assert plugin.hooks.ds_device_set(1) is True
    assert gpu.called("set_device") == [("set_device", (1,), {})]
    assert plugin.hooks.ds_device_current() == 1
    plugin.hooks.ds_device_synchronize(0)
    plugin.hooks.ds_device_synchronize(None)
    assert [c[1] for c in gpu.called("synchronize")] == [("cuda:0",), ("cuda",)]
    with pytest.raises(ValueError, match=r"out of range.*2 device"):
        plugin.hooks.ds_device_set(2)


def test_device_properties_carry_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeCuda(2, capability=(8, 9), name="NVIDIA L40S"))
    props = plugin.hooks.ds_device_properties(1)
    assert (props.name, props.index, props.total_memory) == ("NVIDIA L40S", 1, 140 * GiB)
    assert props.extra["compute_capability"] == "8.9"
    assert props.extra["multi_processor_count"] == 132


def test_rng_hooks(gpu: FakeCuda) -> None:
    plugin.hooks.ds_rng_manual_seed(7, True)
    plugin.hooks.ds_rng_manual_seed(8, False)
    assert gpu.called("manual_seed_all") == [("manual_seed_all", (7,), {})]
    assert gpu.called("manual_seed") == [("manual_seed", (8,), {})]
    state = plugin.hooks.ds_rng_get_state(1)
    assert state.dtype == torch.uint8
    assert gpu.called("get_rng_state")[-1][1] == ("cuda:1",)
    plugin.hooks.ds_rng_set_state(state, None)
    assert gpu.called("set_rng_state")[-1][1][1] == "cuda"
    gpu.current = 1
    assert plugin.hooks.ds_rng_default_generator(None) is gpu.default_generators[1]


def test_default_generator_of_an_explicit_device_initialises_cuda_first(gpu: FakeCuda) -> None:
    # torch fills default_generators at CUDA init; indexing it before then raises IndexError.
    assert gpu.default_generators == ()
    assert plugin.hooks.ds_rng_default_generator(1) is gpu.default_generators[1]


# --------------------------------------------------------------------------- streams


def test_stream_and_event_hooks(gpu: FakeCuda) -> None:
    stream = plugin.hooks.ds_stream_create(1, -1)
    assert gpu.called("Stream") == [("Stream", (), {"device": "cuda:1", "priority": -1})]
    with plugin.hooks.ds_stream_use(stream):
        assert plugin.hooks.ds_stream_current(None) is stream
    assert gpu.called("current_stream")[-1][1] == ("cuda",)
    plugin.hooks.ds_stream_default(0)
    assert gpu.called("default_stream")[-1][1] == ("cuda:0",)
    event = plugin.hooks.ds_stream_event_create(True)
    # CUDA events time on the device: the vendor event itself, not a host-timed wrapper.
    assert type(event).__name__ == "FakeEvent" and event.enable_timing is True


# --------------------------------------------------------------------------- memory


def test_memory_queries(gpu: FakeCuda) -> None:
    assert plugin.hooks.ds_memory_allocated(1) == 3 * GiB
    assert gpu.called("memory_allocated")[-1][1] == ("cuda:1",)
    assert plugin.hooks.ds_memory_max_allocated(None) == 4 * GiB
    assert plugin.hooks.ds_memory_reserved(None) == 4 * GiB
    assert plugin.hooks.ds_memory_reset_peak(0) is True
    assert plugin.hooks.ds_memory_empty_cache() is True
    stats = plugin.hooks.ds_memory_stats(None)
    assert stats["allocated_bytes.all.current"] == 3 * GiB and "not_an_int" not in stats


def test_memory_info_is_device_wide_without_a_fraction(gpu: FakeCuda) -> None:
    info = plugin.hooks.ds_memory_info(1)
    assert (info.total, info.available, info.limit, info.limit_source) == (
        140 * GiB,
        100 * GiB,
        None,
        "",
    )
    assert gpu.called("mem_get_info") == [("mem_get_info", ("cuda:1",), {})]


def test_memory_info_honours_the_per_process_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeCuda(1, fraction=0.5))
    info = plugin.hooks.ds_memory_info(None)
    assert info.total == info.limit == 70 * GiB
    # 70 GiB allowed, 4 GiB already reserved by the allocator; the device has 100 GiB free.
    assert info.available == 66 * GiB
    assert info.limit_source == "torch.cuda.set_per_process_memory_fraction(0.5)"


def test_pinning_refuses_a_device_tensor_and_reports_host_tensors(gpu: FakeCuda) -> None:
    with pytest.raises(ValueError, match="host tensor"):
        plugin.hooks.ds_memory_pin(torch.empty(4, device="meta"))
    assert plugin.hooks.ds_memory_is_pinned(torch.zeros(4)) is False


def test_pinned_buffers_come_from_torch_empty_pinned_and_free_empties_them(
    gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.empty(pin_memory=True): one allocation from the CUDA pinned-host allocator.
    acc = accelerator_for(plugin.hooks, "cuda")
    check_pinned_buffers(acc, PinCalls(monkeypatch), EMPTY_PINNED)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("capability", "bf16", "expected", "absent"),
    [
        ((9, 0), True, {torch.float16, torch.bfloat16, torch.float8_e4m3fn}, set()),
        ((8, 0), True, {torch.float16, torch.bfloat16}, {torch.float8_e4m3fn}),
        ((7, 5), False, {torch.float16}, {torch.bfloat16, torch.float8_e5m2}),
        ((6, 1), False, set(), {torch.float16, torch.bfloat16}),
    ],
)
def test_dtypes_follow_compute_capability_and_native_bf16(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    bf16: bool,
    expected: set[torch.dtype],
    absent: set[torch.dtype],
) -> None:
    fake = install(monkeypatch, FakeCuda(1, capability=capability, bf16=bf16))
    dtypes = plugin.hooks.ds_dtype_supported()
    assert expected | {torch.float32, torch.float64} <= dtypes
    assert not absent & dtypes
    assert fake.called("is_bf16_supported") == [
        ("is_bf16_supported", (), {"including_emulation": False})
    ]


# --------------------------------------------------------------------------- graphs


def test_graph_wraps_cuda_graph_and_its_context(gpu: FakeCuda) -> None:
    graph = plugin.hooks.ds_graph_create()
    stream = gpu.Stream()
    with graph.capture(pool=("pool", 1), stream=stream):
        pass
    _name, args, kwargs = gpu.called("graph")[0]
    assert type(args[0]).__name__ == "CUDAGraph"
    assert kwargs == {"pool": ("pool", 1), "stream": stream}
    graph.replay()
    graph.reset()
    assert gpu.names()[-2:] == ["Graph.replay", "Graph.reset"]
    assert graph.pool() == args[0].pool()


def test_graph_capture_is_off_until_enabled_for_cuda_by_name(gpu: FakeCuda) -> None:
    acc = accelerator_for(plugin.hooks, "cuda")
    with pytest.raises(DSCoreError, match="graph capture is off"):
        acc.create_graph()  # type: ignore[attr-defined]
    acc.configure({"rocm": {"graph_capture": True}})  # type: ignore[attr-defined]
    with pytest.raises(DSCoreError, match="graph capture is off"):
        acc.create_graph()  # type: ignore[attr-defined]
    acc.configure({"cuda": {"graph_capture": True}})  # type: ignore[attr-defined]
    assert type(acc.create_graph().graph).__name__ == "CUDAGraph"  # type: ignore[attr-defined]


def test_a_torch_without_cuda_graphs_declares_the_capability_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, FakeCuda(1, graphs=False))
    assert "graph_capture" not in plugin.hooks.ds_backend_capabilities()
    acc = accelerator_for(plugin.hooks, "cuda")
    with pytest.raises(NotSupportedError, match="graph_capture"):
        acc.configure({"cuda": {"graph_capture": True}})  # type: ignore[attr-defined]


def test_configure_rejects_unknown_options() -> None:
    with pytest.raises(ValueError, match=r"unknown option.*turbo"):
        plugin.hooks.ds_backend_configure({"turbo": True})
    assert plugin.hooks.ds_backend_configure({}) is True


# --------------------------------------------------------------------------- comm, ops


def test_comm_is_nccl_and_prepare_checks_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugin.hooks.ds_comm_backend_name() == "nccl"
    # This CPU-only torch has no NCCL: prepare must say so rather than pretend.
    with pytest.raises(RuntimeError, match="'nccl' is not available"):
        plugin.hooks.ds_comm_prepare()
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert plugin.hooks.ds_comm_prepare() is True


def test_fused_adam_is_torch_fused_adamw() -> None:
    (provider,) = plugin.hooks.ds_op_providers()
    assert provider.name == "fused_adam"
    ok, reason = provider.is_compatible()
    assert ok, reason
    factory = provider.load()
    assert factory.func is torch.optim.AdamW and factory.keywords == {"fused": True}


# --------------------------------------------------------------------------- determinism


@pytest.fixture
def clean_determinism_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_determinism_sets_and_restores_every_knob(
    gpu: FakeCuda, clean_determinism_env: None
) -> None:
    torch.backends.cudnn.benchmark = True
    record = plugin.hooks.ds_determinism_apply(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
    assert record.env == {
        "CUBLAS_WORKSPACE_CONFIG": (None, ":4096:8"),
        "NCCL_ALGO": (None, "Ring"),
    }
    assert record.settings["torch.backends.cudnn.benchmark"] == (True, False)

    assert plugin.hooks.ds_determinism_restore(record) is True
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "NCCL_ALGO" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic is False and torch.backends.cudnn.benchmark is True


def test_determinism_keeps_a_valid_user_workspace_and_warns_when_cuda_is_up(
    gpu: FakeCuda, clean_determinism_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    gpu.initialized = True
    record = plugin.hooks.ds_determinism_apply(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in record.env
    assert any("already initialised" in n for n in record.notes)
    plugin.hooks.ds_determinism_restore(record)


def test_disabling_determinism_leaves_autotuning_alone(
    gpu: FakeCuda, clean_determinism_env: None
) -> None:
    torch.backends.cudnn.benchmark = False
    record = plugin.hooks.ds_determinism_apply(False)
    assert "torch.backends.cudnn.benchmark" not in record.settings
    assert torch.backends.cudnn.benchmark is False and record.env == {}


# --------------------------------------------------------------------------- launcher


def test_launcher_environment() -> None:
    assert plugin.hooks.ds_launcher_visible_devices_env() == ["CUDA_VISIBLE_DEVICES"]
    prefixes = plugin.hooks.ds_launcher_env_prefixes()
    assert "NCCL_" in prefixes and "PYTORCH_CUDA_ALLOC_CONF" in prefixes
    assert "CUDA_VISIBLE_DEVICES" not in prefixes  # set per rank by the launcher, not copied


# --------------------------------------------------------------------------- kit details


def test_graph_of_a_vendor_without_pools_refuses_a_pool(gpu: FakeCuda) -> None:
    graph = TorchStyleGraph(gpu.CUDAGraph(), gpu.graph, accepts_pool=False)
    with pytest.raises(ValueError, match="cannot share a memory pool"):
        graph.capture(pool=("pool", 1))
    with graph.capture(stream="s"):
        pass
    assert gpu.called("graph")[-1][2] == {"stream": "s"}
    assert graph.pool() is None


def test_a_policy_refuses_to_restore_another_backends_record() -> None:
    policy = DeterminismPolicy([])
    foreign = DeterminismRecord(settings={"vendor.flag": (False, True)})
    with pytest.raises(ValueError, match=r"vendor\.flag"):
        policy.restore(foreign)


def test_probe_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="top-level"):
        module_present("torch.cuda")
    assert module_present("torch") and not module_present("no_such_vendor_stack")
    monkeypatch.delenv("A_MASK", raising=False)
    monkeypatch.setenv("B_MASK", "2,3,5")
    assert visible_device_count(["A_MASK", "B_MASK"], 8) == 3
    assert visible_device_count(["A_MASK", "B_MASK"], 2) == 2
    monkeypatch.setenv("A_MASK", "")
    assert visible_device_count(["A_MASK", "B_MASK"], 8) == 0
    assert dist_version("no-such-distribution", "torch") == torch.__version__
    assert dist_version("no-such-distribution") == ""


def test_execution_model_flags_are_deepspeeds_for_cuda(gpu: FakeCuda) -> None:
    # DeepSpeed's CUDA accelerator: every flag follows "synchronised device", which it is not.
    acc: Any = accelerator_for(plugin.hooks, "cuda")
    flags = (
        acc.is_synchronized_device(),
        acc.use_host_timers(),
        acc.resolves_data_dependency(),
        acc.handles_memory_backpressure(),
    )
    assert flags == (False, False, False, False)


def test_profiler_ranges_go_to_nvtx_and_an_unmatched_pop_raises(gpu: FakeCuda) -> None:
    acc: Any = accelerator_for(plugin.hooks, "cuda")
    acc.range_push("ds::step")
    acc.range_pop()
    assert gpu.called("nvtx.range_push")[0][1] == ("ds::step",)
    assert gpu.names().count("nvtx.range_pop") == 1
    with pytest.raises(DSCoreError, match="range_pop"):
        acc.range_pop()


class _LeakyCapture:
    """torch.cuda.graph as torch 2.11 behaves when ``capture_end`` raises: its ``__exit__``
    never leaves the side stream, and the generators' capture epilogue never runs."""

    def __init__(self, vendor: Any, graph: Any, **kwargs: Any) -> None:
        self.vendor = vendor

    def __enter__(self) -> None:
        self.vendor.current = "side"
        for gen in self.vendor.default_generators:
            gen.state = "capturing"

    def __exit__(self, *exc: object) -> None:
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


class _Generator:
    def __init__(self) -> None:
        self.state = "idle"

    def clone_state(self) -> str:
        return self.state

    def graphsafe_set_state(self, state: str) -> None:
        self.state = state


def test_a_failed_capture_restores_the_stream_and_the_generators(gpu: FakeCuda) -> None:
    """On an H200 (torch 2.11+cu130) a capture failed by .item() left the side stream current
    and the generator capturing, so every later torch.rand raised."""
    vendor = SimpleNamespace(current="default", default_generators=(_Generator(), _Generator()))
    vendor.current_stream = lambda: vendor.current
    vendor.set_stream = lambda stream: setattr(vendor, "current", stream)
    vendor_graph = gpu.CUDAGraph()
    graph = TorchStyleGraph(
        vendor_graph, lambda g, **kw: _LeakyCapture(vendor, g, **kw), vendor=vendor
    )
    with pytest.raises(RuntimeError, match="during capture"):
        with graph.capture():
            raise RuntimeError("operation not permitted when stream is capturing")
    assert vendor.current == "default"
    assert [g.state for g in vendor.default_generators] == ["idle", "idle"]
    assert gpu.called("Graph.reset")  # the half-recorded graph cannot be replayed


def test_elapsed_time_without_timing_raises_runtime_error_as_specified() -> None:
    """torch 2.11's torch.cuda.Event raises ValueError here (seen on an H200); the spec names
    RuntimeError, so the kit's event class translates it and stays a vendor event."""
    from ds_core.backend_kit.torch_style import _spec_event_class

    class VendorEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.enable_timing = enable_timing

        def elapsed_time(self, end_event: Any) -> float:
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")

    cls = _spec_event_class(VendorEvent)
    assert issubclass(cls, VendorEvent) and _spec_event_class(VendorEvent) is cls
    event = cls(enable_timing=False)
    with pytest.raises(RuntimeError, match="enable_timing"):
        event.elapsed_time(cls())
