"""A recording fake of a torch-style vendor device module, for contract tests of any vendor.

Vendor device modules (``torch.<type>``, or a vendor package's equivalent) share one API shape;
``ds_core.backend_kit.TorchStyleHooks`` drives that shape. :class:`FakeDeviceModule` implements
it on the host without a device and records every call as ``(name, args, kwargs)`` in
``calls``, so a test can assert that a backend made the documented call with the right
arguments (device strings, priorities, graph class) and translated the result.

Reuse it for any backend: build one, add vendor-specific attributes (a graph class under the
vendor's name with :meth:`FakeDeviceModule.add_graph_api`, ``is_bf16_supported``...), and put it
where the backend looks (``monkeypatch.setattr(torch, "<type>", fake)``, or a fake package in
``sys.modules``). Vendor-specific fakes live next to this file (``fake_cuda.py``,
``fake_xmlir.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

GiB = 1 << 30

Call = tuple[str, tuple[Any, ...], dict[str, Any]]

#: Default of the RNG calls' ``device``: the module's own bare type string, as in torch.
_OWN_TYPE: Any = object()


class FakeEvent:
    """A device event that records its calls; ``elapsed_time`` returns ``timing_ms``."""

    def __init__(self, module: FakeDeviceModule, enable_timing: bool) -> None:
        self.module = module
        self.enable_timing = enable_timing
        self.recorded_on: Any = None

    def record(self, stream: Any = None) -> None:
        self.module.log("Event.record", stream)
        self.recorded_on = stream

    def wait(self, stream: Any = None) -> None:
        self.module.log("Event.wait", stream)

    def synchronize(self) -> None:
        self.module.log("Event.synchronize")

    def query(self) -> bool:
        self.module.log("Event.query")
        return True

    def elapsed_time(self, end_event: Any) -> float:
        self.module.log("Event.elapsed_time", end_event)
        return self.module.event_timing_ms


class FakeStream:
    """A device stream that records its calls."""

    def __init__(self, module: FakeDeviceModule, device: Any, priority: int) -> None:
        self.module = module
        self.device = device
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        self.module.log("Stream.wait_stream", stream)

    def wait_event(self, event: Any) -> None:
        self.module.log("Stream.wait_event", event)

    def record_event(self, event: Any = None) -> Any:
        self.module.log("Stream.record_event", event)
        return event

    def synchronize(self) -> None:
        self.module.log("Stream.synchronize", self)

    def query(self) -> bool:
        return True


class FakeGraph:
    """A vendor graph object: counts replays and resets; ``pool()`` returns a handle."""

    def __init__(self, module: FakeDeviceModule, *args: Any, **kwargs: Any) -> None:
        self.module = module
        self.init_args = (args, kwargs)
        self.replays = 0
        self.captured = False
        module.log("Graph.__init__", *args, **kwargs)

    def replay(self) -> None:
        self.module.log("Graph.replay")
        self.replays += 1

    def reset(self) -> None:
        self.module.log("Graph.reset")
        self.captured = False

    def pool(self) -> tuple[str, int]:
        return ("pool", id(self))


class FakeDeviceModule:
    """A torch-style device module with ``count`` devices, recording every call.

    :param device_type: the device type string the vendor's devices use.
    :param count: devices reported by ``device_count()``.
    :param total: bytes of memory per device; ``free`` bytes are reported free.
    :param props: extra attributes of ``get_device_properties()``'s result.
    """

    def __init__(
        self,
        device_type: str,
        count: int = 2,
        *,
        total: int = 80 * GiB,
        free: int = 60 * GiB,
        name: str = "Fake Accelerator",
        props: dict[str, Any] | None = None,
    ) -> None:
        self.device_type = device_type
        self.count = count
        self.total = total
        self.free = free
        self.name = name
        self.props = dict(props or {})
        self.calls: list[Call] = []
        self.current = 0
        self.allocated = 3 * GiB
        self.reserved = 4 * GiB
        self.event_timing_ms = 0.0
        self.default_generators = tuple(torch.Generator() for _ in range(count))
        self._default_streams = [FakeStream(self, i, 0) for i in range(count)]
        self._stream_stack: list[FakeStream] = []

    # -- recording -------------------------------------------------------------------------

    def log(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    def called(self, name: str) -> list[Call]:
        """The recorded calls of ``name``, in order."""
        return [c for c in self.calls if c[0] == name]

    def names(self) -> list[str]:
        """Names of every recorded call, in order."""
        return [c[0] for c in self.calls]

    def index_of(self, what: str, device: Any, *, optional: bool = True) -> int:
        """Parse a device argument the way torch's ``_get_device_index`` does, strictly.

        Accepts an int, ``"<type>:<i>"``, a ``torch.device`` of this type, and, when torch's
        call passes ``optional=True``, ``None`` or the bare ``"<type>"`` (meaning the current
        device). Anything torch would reject raises ``ValueError`` naming the call, so a
        backend passing a form the real module refuses fails its contract test.
        """
        if device is None:
            if optional:
                return self.current
            raise ValueError(f"fake {self.device_type}.{what}: torch fails on device=None here")
        if isinstance(device, int):
            index: int | None = device
        else:
            text = str(device)
            kind, _, number = text.partition(":")
            if kind != self.device_type:
                raise ValueError(
                    f"fake {self.device_type}.{what}: expected a {self.device_type} device, "
                    f"got {device!r}"
                )
            index = int(number) if number else None
        if index is None:
            if not optional:
                raise ValueError(
                    f"fake {self.device_type}.{what}: torch needs an explicit index here "
                    f"(it raises 'Expected a torch.device with a specified index'), got {device!r}"
                )
            index = self.current
        if not 0 <= index < self.count:
            raise ValueError(
                f"fake {self.device_type}.{what}: device index {index} is out of range "
                f"({self.count} devices)"
            )
        return index

    # -- device ----------------------------------------------------------------------------

    def device_count(self) -> int:
        self.log("device_count")
        return self.count

    def current_device(self) -> int:
        self.log("current_device")
        return self.current

    def set_device(self, index: int) -> None:
        self.log("set_device", index)
        self.index_of("set_device", index, optional=False)
        self.current = index

    def synchronize(self, device: Any = None) -> None:
        self.log("synchronize", device)
        self.index_of("synchronize", device)

    def get_device_properties(self, index: int) -> SimpleNamespace:
        self.log("get_device_properties", index)
        self.index_of("get_device_properties", index)
        return SimpleNamespace(name=self.name, total_memory=self.total, **self.props)

    # -- rng -------------------------------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        self.log("manual_seed", seed)

    def manual_seed_all(self, seed: int) -> None:
        self.log("manual_seed_all", seed)

    def get_rng_state(self, device: Any = _OWN_TYPE) -> torch.Tensor:
        # torch's default is the bare type string ("cuda"); an explicit None fails there.
        device = self.device_type if device is _OWN_TYPE else device
        self.log("get_rng_state", device)
        self.index_of("get_rng_state", device, optional=device is not None)
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, new_state: torch.Tensor, device: Any = _OWN_TYPE) -> None:
        device = self.device_type if device is _OWN_TYPE else device
        self.log("set_rng_state", new_state, device)
        self.index_of("set_rng_state", device, optional=device is not None)

    # -- streams and events ----------------------------------------------------------------

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802
        self.log("Stream", device=device, priority=priority)
        self.index_of("Stream", device)
        return FakeStream(self, device, priority)

    def current_stream(self, device: Any = None) -> FakeStream:
        self.log("current_stream", device)
        self.index_of("current_stream", device)
        return self._stream_stack[-1] if self._stream_stack else self._default_streams[0]

    def default_stream(self, device: Any = None) -> FakeStream:
        self.log("default_stream", device)
        self.index_of("default_stream", device)
        return self._default_streams[0]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        self.log("stream", stream)
        self._stream_stack.append(stream)
        try:
            yield stream
        finally:
            self._stream_stack.pop()

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        self.log("Event", enable_timing=enable_timing)
        return FakeEvent(self, enable_timing)

    # -- memory ----------------------------------------------------------------------------

    def memory_allocated(self, device: Any = None) -> int:
        self.log("memory_allocated", device)
        self.index_of("memory_allocated", device)
        return self.allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        self.log("max_memory_allocated", device)
        self.index_of("max_memory_allocated", device)
        return self.allocated + GiB

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.log("reset_peak_memory_stats", device)
        self.index_of("reset_peak_memory_stats", device)

    def memory_reserved(self, device: Any = None) -> int:
        self.log("memory_reserved", device)
        self.index_of("memory_reserved", device)
        return self.reserved

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        self.log("memory_stats", device)
        self.index_of("memory_stats", device)
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.allocated + GiB,
            "num_alloc_retries": 0,
            "not_an_int": 1.5,
        }

    def empty_cache(self) -> None:
        self.log("empty_cache")

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self.log("mem_get_info", device)
        self.index_of("mem_get_info", device)
        return self.free, self.total

    # -- optional APIs -----------------------------------------------------------------------

    def add_memory_fraction(self, fraction: float) -> None:
        """Give the module ``get_per_process_memory_fraction`` returning ``fraction``."""

        def get_per_process_memory_fraction(device: Any = None) -> float:
            self.log("get_per_process_memory_fraction", device)
            # torch resolves None itself, then parses the rest without optional=True.
            if device is not None:
                self.index_of("get_per_process_memory_fraction", device, optional=False)
            return fraction

        self.get_per_process_memory_fraction = get_per_process_memory_fraction

    def add_graph_api(self, class_name: str, context_name: str = "graph") -> None:
        """Give the module a graph class named ``class_name`` and a capture context manager.

        The context records ``(context_name, graph, pool=, stream=, **kwargs)`` and marks the
        graph captured on a clean exit.
        """
        module = self

        class VendorGraph(FakeGraph):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(module, *args, **kwargs)

        VendorGraph.__name__ = VendorGraph.__qualname__ = class_name

        @contextlib.contextmanager
        def capture(graph: FakeGraph, **kwargs: Any) -> Iterator[FakeGraph]:
            module.log(context_name, graph, **kwargs)
            yield graph
            graph.captured = True

        setattr(self, class_name, VendorGraph)
        setattr(self, context_name, capture)
