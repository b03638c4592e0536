"""The Accelerator facade: direct binding, wrapper routing, capability gating."""

from __future__ import annotations

import inspect
import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
from ds_backend_cpu import plugin as cpu

import ds_core
from ds_core import NotSupportedError, hookimpl
from ds_core.accelerator import DIRECT
from ds_core.binding import DEFAULTED


@pytest.fixture
def acc() -> Iterator[ds_core.Accelerator]:
    ds_core.reset_accelerator()
    ds_core.set_accelerator("cpu")
    yield ds_core.get_accelerator()
    ds_core.reset_accelerator()


class CallCounter:
    """A wrapper plugin, like a tracer or a byte counter would be."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl(wrapper=True)
    def ds_device_current(self) -> Generator[None, int, int]:
        self.calls.append("ds_device_current")
        return (yield)

    @hookimpl(wrapper=True)
    def ds_memory_allocated(self, index: int | None) -> Generator[None, int, int]:
        self.calls.append(f"ds_memory_allocated({index})")
        return (yield)


def test_hot_hooks_are_bound_to_the_implementation_itself(acc: ds_core.Accelerator) -> None:
    assert acc.current_device is cpu.ds_device_current
    assert acc.set_device is cpu.ds_device_set
    assert acc.stream is cpu.ds_stream_use
    assert set(DIRECT) <= set(dir(acc))
    assert acc.binding()["ds_memory_allocated"] == "direct"


def test_no_facade_method_is_shadowed_by_a_bound_hook(acc: ds_core.Accelerator) -> None:
    # A hook bound as an instance attribute must not hide a class attribute of the same name:
    # that method's body would never run. Bound hooks are declared by annotation only.
    shadowed = [n for n in vars(acc) if inspect.getattr_static(ds_core.Accelerator, n, None)]
    assert not shadowed, f"instance attributes hide facade methods: {shadowed}"
    annotations = inspect.get_annotations(ds_core.Accelerator)
    for name in [*DIRECT, *DEFAULTED]:
        assert name in annotations and name in vars(acc)
        assert name not in vars(ds_core.Accelerator)
    ds_core.register_plugin(counter := CallCounter())
    try:
        assert not [n for n in vars(acc) if inspect.getattr_static(ds_core.Accelerator, n, None)]
    finally:
        ds_core.unregister_plugin(counter)


def test_defaulted_bindings_fill_in_deepspeeds_defaults(acc: ds_core.Accelerator) -> None:
    assert acc.current_stream() is cpu.ds_stream_current(None)
    assert acc.Stream().priority == 0 and acc.Stream(0, -1).priority == -1
    state = acc.get_rng_state()
    assert acc.set_rng_state(state) and torch.equal(acc.get_rng_state(0), state)
    assert acc.Event().enable_timing is False and acc.Event(True).enable_timing is True
    # callers pass the spec's names by keyword too
    assert acc.Event(enable_timing=True).enable_timing is True
    assert acc.Stream(index=0, priority=-1).priority == -1
    assert acc.set_rng_state(state=state, index=0) and acc.memory_allocated(index=0) > 0
    ds_core.register_plugin(counter := CallCounter())
    try:
        acc.memory_allocated()
        acc.memory_allocated(0)
        assert counter.calls == ["ds_memory_allocated(None)", "ds_memory_allocated(0)"]
    finally:
        ds_core.unregister_plugin(counter)


def test_collectives_bind_to_the_backend_override_before_the_core_default(
    acc: ds_core.Accelerator,
) -> None:
    # the cpu backend overrides every collective (shared memory, gloo fallback); the core's
    # default plugin still implements them, last in line
    for hook in ("ds_comm_reduce_scatter", "ds_comm_barrier"):
        bound = getattr(acc._h, hook)
        assert bound is getattr(cpu, hook)
        impls = getattr(acc._pm.hook, hook).get_hookimpls()
        assert impls[0].function.__qualname__ == f"DefaultCollectives.{hook}"
        assert bound is not impls[0].function


def test_a_wrapper_plugin_sees_calls_and_unregistering_restores_direct_binding(
    acc: ds_core.Accelerator,
) -> None:
    counter = CallCounter()
    ds_core.register_plugin(counter)
    os.environ["LOCAL_RANK"] = "0"
    assert acc.current_device() == 0
    assert acc.memory_allocated() > 0
    assert counter.calls == ["ds_device_current", "ds_memory_allocated(None)"]
    assert acc.binding()["ds_device_current"] == "pluggy"
    assert acc.binding()["ds_device_count"] == "direct"  # unwrapped hooks stay direct
    ds_core.unregister_plugin(counter)
    acc.current_device()
    assert len(counter.calls) == 2
    assert acc.current_device is cpu.ds_device_current


def test_a_plugin_registered_before_selection_is_applied_at_selection() -> None:
    ds_core.reset_accelerator()
    counter = CallCounter()
    ds_core.register_plugin(counter)
    ds_core.set_accelerator("cpu")
    ds_core.get_accelerator().current_device()
    assert counter.calls == ["ds_device_current"]
    ds_core.reset_accelerator()


def test_absent_capability_raises_not_supported(acc: ds_core.Accelerator) -> None:
    assert "pinned_memory" not in acc.capabilities
    with pytest.raises(NotSupportedError) as info:
        acc.pin_memory(torch.ones(4))
    assert info.value.capability == "pinned_memory" and info.value.backend == "cpu"
    assert "does not declare" in str(info.value)
    with pytest.raises(NotSupportedError):
        acc.require("async_streams", "overlapping communication")


def test_graph_capture_is_refused_until_enabled_for_this_backend_by_name(
    acc: ds_core.Accelerator,
) -> None:
    if not acc.has("graph_capture"):
        with pytest.raises(NotSupportedError):
            acc.create_graph()
        with pytest.raises(NotSupportedError):
            acc.configure({"cpu": {"graph_capture": True}})
        return
    acc.configure({"other-accelerator": {"graph_capture": True}})
    with pytest.raises(ds_core.DSCoreError, match="graph capture is off on 'cpu'"):
        acc.create_graph()


def test_configure_validates_its_section(acc: ds_core.Accelerator) -> None:
    with pytest.raises(
        ds_core.ConfigError, match=r"accelerator.cpu.graph_capture must be true or false"
    ):
        acc.configure({"cpu": {"graph_capture": "yes"}})
    with pytest.raises(ds_core.ConfigError, match=r"accelerator\.cpu has no options; remove turbo"):
        acc.configure({"cpu": {"turbo": 1}})


def test_capabilities_include_dtype_derived_ones(acc: ds_core.Accelerator) -> None:
    caps = acc.capabilities
    assert {"fp16", "bf16", "fp64"} <= caps
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    with pytest.raises(ValueError, match="unknown capability 'warp'"):
        acc.has("warp")


def test_device_naming_follows_deepspeed(acc: ds_core.Accelerator) -> None:
    assert acc.device_name() == "cpu"
    assert acc.current_device_name() == "cpu"
    assert acc.device() == torch.device("cpu")
    assert acc.on_accelerator(torch.zeros(1))
    assert acc.communication_backend_name() == "gloo"


def test_op_providers_and_get_op(acc: ds_core.Accelerator) -> None:
    provider = acc.get_op("fused_adam")
    ok, _reason = provider.is_compatible()
    assert ok
    opt_cls: Any = provider.load()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    ref = torch.nn.Parameter(torch.ones(3))
    ref.grad = torch.ones(3)
    opt_cls([p], lr=0.1).step()
    torch.optim.AdamW([ref], lr=0.1).step()
    torch.testing.assert_close(p, ref)
    with pytest.raises(ds_core.DSCoreError, match="no provider of op 'flash' on backend 'cpu'"):
        acc.get_op("flash")


def test_execution_model_flags_derive_from_capabilities(acc: ds_core.Accelerator) -> None:
    assert acc.is_synchronized_device() and acc.resolves_data_dependency()
    assert acc.use_host_timers() and acc.handles_memory_backpressure()
    acc.manual_seed(1234)
    assert acc.initial_seed() == 1234


def test_profiler_ranges_show_up_in_the_torch_profiler(acc: ds_core.Accelerator) -> None:
    with torch.profiler.profile() as prof:
        acc.range_push("ds::step")
        torch.ones(8) * 2
        acc.range_pop()
    assert any(e.name == "ds::step" for e in prof.events())
    with pytest.raises(ds_core.DSCoreError, match="range_pop"):
        acc.range_pop()
