"""DeepSpeed's accelerator interface, answered by the selected ds_core backend (docs/interop.md).

:func:`adapter` returns an object that *is* a ``deepspeed.accelerator.DeepSpeedAccelerator``
(DeepSpeed's ``set_accelerator`` accepts it) and forwards every call to
``ds_core.get_accelerator()``. :func:`install` hands it to DeepSpeed before DeepSpeed picks an
accelerator of its own, so ``DS_ACCELERATOR`` may name any ds_core backend (``sim``, ``npu``,
...), not only the ones DeepSpeed lists.

DeepSpeed is imported only by :func:`adapter_class`, :func:`adapter` and :func:`install` (and
by DeepSpeed's own code). The class is assembled on first use from :class:`DeepSpeedMethods`
and DeepSpeed's abstract base, so importing this module costs nothing when DeepSpeed is absent.

What a backend lacks is refused, never faked: a call that needs a capability the backend does
not declare raises :class:`ds_core.NotSupportedError` naming both; an op builder nothing
provides loads into :class:`OpNotAvailableError` naming the op and the backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.errors import DSCoreError, NotSupportedError
from ds_core.facade import Accelerator
from ds_core.interop.deepspeed_ops import (
    OPTIONAL_BUILDERS,
    PROVIDER_BUILDERS,
    OpNotAvailableError,
    provider_builder,
    refused_builder,
)

__all__ = [
    "ENV_HOOK",
    "OPTIONAL_BUILDERS",
    "PROVIDER_BUILDERS",
    "DeepSpeedMethods",
    "OpNotAvailableError",
    "adapter",
    "adapter_class",
    "install",
]

#: Set to ``1`` to install the adapter at interpreter start (``ds_core_deepspeed.pth``).
ENV_HOOK = "DS_CORE_DEEPSPEED"

_REAL = "deepspeed.accelerator.real_accelerator"


# --------------------------------------------------------------------------- the adapter


class DeepSpeedMethods:
    """Every method of DeepSpeed 0.19.8's ``DeepSpeedAccelerator``, on a ds_core backend.

    Mixed into DeepSpeed's abstract base by :func:`adapter_class`; argument names and defaults
    are DeepSpeed's (``device_index``, ``Stream(device=None, priority=0)``, ...). Indices
    default to the current device. DeepSpeed's engine also reads the ``_name`` and
    ``_communication_backend_name`` attributes: the torch device type and the comm backend.
    """

    supports_nvtx_domain = False

    def __init__(self, accelerator: Accelerator | None = None) -> None:
        self.ds_core = accelerator if accelerator is not None else get_accelerator()
        self._name = self.ds_core.device_type
        self._communication_backend_name = self.ds_core.communication_backend_name()
        self._comm_prepared = False
        self._compile_backend = "inductor"
        self._lock = threading.Lock()
        self._deepspeed_native: Any = None
        self._native_looked_up = False

    def __repr__(self) -> str:
        return f"<DeepSpeed accelerator on ds_core backend '{self.ds_core.name}'>"

    def _require(self, capability: str, what: str) -> None:
        if not self.ds_core.has(capability):
            raise NotSupportedError(capability, self.ds_core.name, what)

    # -- execution model -------------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        return self.ds_core.is_synchronized_device()

    def use_host_timers(self) -> bool:
        return self.ds_core.use_host_timers()

    def resolves_data_dependency(self) -> bool:
        return self.ds_core.resolves_data_dependency()

    def handles_memory_backpressure(self) -> bool:
        return self.ds_core.handles_memory_backpressure()

    # -- device ----------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        return self.ds_core.device_name(device_index)

    def device(self, device_index: int | None = None) -> torch.device:
        return self.ds_core.device(device_index)

    def set_device(self, device_index: Any) -> None:
        # DeepSpeed passes an index or a torch.device; a device without an index (``cpu``)
        # names the current device.
        index = _index(device_index)
        if index is not None:
            self.ds_core.set_device(index)

    def current_device(self) -> int:
        return self.ds_core.current_device()

    def current_device_name(self) -> str:
        return self.ds_core.current_device_name()

    def device_count(self) -> int:
        return self.ds_core.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        self.ds_core.synchronize(device_index)

    def is_available(self) -> bool:
        return self.ds_core.is_available()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return self.ds_core.on_accelerator(tensor)

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        # ds_core backends have no deferred-initialisation queue: the device is usable once
        # selected, so the callback runs now (as on DeepSpeed's CPU accelerator).
        return callback()

    # -- rng -------------------------------------------------------------------------------

    def random(self) -> ModuleType:
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        self.ds_core.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self.ds_core.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        self.ds_core.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.ds_core.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return self.ds_core.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return self.ds_core.default_generator(device_index)

    # -- streams and events ----------------------------------------------------------------

    @property
    def Stream(self) -> Callable[..., Any]:  # noqa: N802 - DeepSpeed's name
        """``Stream(device=None, priority=0)``: a new stream (synchronous without
        ``async_streams``)."""
        create = self.ds_core.Stream

        def stream(device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
            index = _index(device if device is not None else kwargs.get("device_index"))
            return create(index, priority)

        return stream

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        if stream is None:  # DeepSpeed passes None for "no side stream" on some paths
            return _nothing()
        return self.ds_core.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self.ds_core.current_stream(_index(device_index))

    def default_stream(self, device_index: int | None = None) -> Any:
        return self.ds_core.default_stream(_index(device_index))

    @property
    def Event(self) -> Callable[..., Any]:  # noqa: N802 - DeepSpeed's name
        """``Event(enable_timing=False)``: a new event (``elapsed_time`` in milliseconds)."""
        create = self.ds_core.Event

        def event(enable_timing: bool = False, **kwargs: Any) -> Any:
            return create(enable_timing)

        return event

    # -- memory (bytes) --------------------------------------------------------------------

    def empty_cache(self) -> None:
        self.ds_core.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self.ds_core.memory_allocated(_index(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self.ds_core.max_memory_allocated(_index(device_index))

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.ds_core.reset_peak_memory_stats(_index(device_index))

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.ds_core.memory_reserved(_index(device_index))

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.ds_core.reset_peak_memory_stats(_index(device_index))

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        return self.ds_core.memory_stats(_index(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.ds_core.reset_peak_memory_stats(_index(device_index))

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self.ds_core.memory_reserved(_index(device_index))

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        stats = self.ds_core.memory_stats(_index(device_index))
        for key in ("reserved_bytes.all.peak", "allocated_bytes.all.peak"):
            # A backend that reports no separate reserved peak reserves exactly what it
            # allocates (reserved_bytes.all.current == allocated_bytes.all.current).
            if key in stats and (
                key.startswith("reserved")
                or stats.get("reserved_bytes.all.current")
                == stats.get("allocated_bytes.all.current")
            ):
                return int(stats[key])
        raise DSCoreError(
            f"backend '{self.ds_core.name}' reports no peak of reserved memory "
            f"(memory_stats has no 'reserved_bytes.all.peak'); max_memory_reserved() "
            f"cannot be answered"
        )

    def total_memory(self, device_index: int | None = None) -> int:
        return self.ds_core.total_memory(_index(device_index))

    def available_memory(self, device_index: int | None = None) -> int:
        return self.ds_core.available_memory(_index(device_index))

    # -- pinned host memory (DeepSpeed's base class dispatches here) -----------------------

    _torch_pins_host_memory = True

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.ds_core.pin_memory(tensor)

    def _torch_empty_pinned(self, tensor: torch.Tensor, shape: Any) -> torch.Tensor:
        return self.ds_core.alloc_pinned(tuple(int(d) for d in shape), tensor.dtype)

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.ds_core.is_pinned(tensor)

    # -- dtypes ----------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return self.ds_core.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return self.ds_core.is_fp16_supported()

    def is_fp64_supported(self) -> bool:
        return self.ds_core.is_fp64_supported()

    def supported_dtypes(self) -> list[torch.dtype]:
        return sorted(self.ds_core.supported_dtypes(), key=str)

    def _tensor_factory(self, dtype: torch.dtype, capability: str | None) -> Any:
        if capability is not None:
            self._require(capability, f"{capability} tensors ({dtype})")
        return functools.partial(torch.tensor, dtype=dtype, device=self.ds_core.device_type)

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.bfloat16, "bf16")

    @property
    def ByteTensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.uint8, None)

    @property
    def DoubleTensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.float64, "fp64")

    @property
    def FloatTensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.float32, None)

    @property
    def HalfTensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.float16, "fp16")

    @property
    def IntTensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.int32, None)

    @property
    def LongTensor(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return self._tensor_factory(torch.int64, None)

    # -- profiler and communication --------------------------------------------------------

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        self.ds_core.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        self.ds_core.range_pop()

    def communication_backend_name(self) -> str:
        # DeepSpeed passes this name straight to torch.distributed: register the backend's
        # process-group class with torch first (a no-op where torch has it built in).
        if not self._comm_prepared:
            self.ds_core.prepare_communication()
            self._comm_prepared = True
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False  # no ds_core capability promises Triton kernels

    # -- graph capture (needs the ``graph_capture`` capability) ----------------------------

    def create_graph(self) -> Any:
        return self.ds_core.create_graph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        self._require("graph_capture", "capture_to_graph()")
        return self.ds_core.capture_to_graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        self._require("graph_capture", "replay_graph()")
        self.ds_core.replay_graph(graph)

    # -- launcher --------------------------------------------------------------------------

    def export_envs(self) -> list[str]:
        return self.ds_core.export_envs()

    def visible_devices_envs(self) -> list[str]:
        return self.ds_core.visible_devices_envs()

    def set_visible_devices_envs(
        self, current_env: dict[str, str], local_accelerator_ids: list[int]
    ) -> None:
        self.ds_core.set_visible_devices_envs(current_env, list(local_accelerator_ids))

    # -- torch.compile ---------------------------------------------------------------------

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(
                f"compile backend '{backend}' is not one torch knows here: {', '.join(supported)}"
            )
        self._compile_backend = backend

    # -- op builders -----------------------------------------------------------------------

    def _native(self) -> Any:
        """DeepSpeed's own accelerator for this device type, for its op builders (or None)."""
        with self._lock:
            if not self._native_looked_up:
                self._native_looked_up = True
                self._deepspeed_native = _deepspeed_accelerator_for(self._name)
            return self._deepspeed_native

    def op_builder_dir(self) -> str:
        """DeepSpeed's builder package for this device type; DeepSpeed's host builders
        (``deepspeed.ops.op_builder.cpu``) where DeepSpeed has none for it, so that DeepSpeed's
        builder listing finds the ds_core-mapped ones."""
        native = self._native()
        if native is not None:
            return str(native.op_builder_dir())
        return "deepspeed.ops.op_builder.cpu"

    def get_op_builder(self, class_name: str) -> Any:
        """The builder class for ``class_name``: ds_core's provider where one is mapped
        (:data:`PROVIDER_BUILDERS`), else DeepSpeed's builder for this device type, else
        ``None`` for :data:`OPTIONAL_BUILDERS`, else a builder whose ``load()`` raises
        :class:`OpNotAvailableError`."""
        if class_name in PROVIDER_BUILDERS and any(
            p.name == PROVIDER_BUILDERS[class_name] for p in self.ds_core.op_providers()
        ):
            return provider_builder(class_name)
        native = self._native()
        if native is not None:
            found = native.get_op_builder(class_name)
            if found is not None and getattr(found, "__name__", "") != "NotImplementedBuilder":
                return found
        if class_name in OPTIONAL_BUILDERS:
            return None
        return refused_builder(class_name, self.ds_core.name, self._name)

    def create_op_builder(self, class_name: str) -> Any:
        builder = self.get_op_builder(class_name)
        return None if builder is None else builder()

    def build_extension(self) -> Any:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension


def _index(device: Any) -> int | None:
    """A device index from DeepSpeed's ``device``/``device_index`` argument forms."""
    if device is None or isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        return device.index
    if isinstance(device, str):
        return torch.device(device).index
    return int(device)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _deepspeed_accelerator_for(device_type: str) -> Any:
    """DeepSpeed's own accelerator object for ``device_type``, or None where it has none."""
    module_name = f"deepspeed.accelerator.{device_type}_accelerator"
    if importlib.util.find_spec(module_name) is None:
        return None
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

    module = importlib.import_module(module_name)
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, DeepSpeedAccelerator)
            and value is not DeepSpeedAccelerator
            and value.__module__ == module_name
        ):
            return value()
    return None


# --------------------------------------------------------------------------- assembly


_CLASS: type[DeepSpeedMethods] | None = None


def adapter_class() -> type[DeepSpeedMethods]:
    """``DeepSpeedAdapter``: :class:`DeepSpeedMethods` + DeepSpeed's ``DeepSpeedAccelerator``.

    Imports DeepSpeed (through :func:`install`'s path when it is not imported yet, so DeepSpeed
    never checks ``DS_ACCELERATOR`` itself).

    :raises ImportError: when DeepSpeed is not installed (``pip install "ds-core[deepspeed]"``).
    """
    global _CLASS
    if _CLASS is None and _REAL not in sys.modules:
        _import_deepspeed()  # the hook builds the class (re-entering here) and installs it
    if _CLASS is None:
        from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

        cls = type(
            "DeepSpeedAdapter",
            (DeepSpeedMethods, DeepSpeedAccelerator),
            {"__module__": __name__, "__doc__": DeepSpeedMethods.__doc__},
        )
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:  # a DeepSpeed release with methods this adapter does not know
            raise DSCoreError(
                f"this DeepSpeed's DeepSpeedAccelerator has methods ds_core's adapter lacks: "
                f"{', '.join(missing)}"
            )
        _CLASS = cls
    return _CLASS


def adapter(accelerator: Accelerator | None = None) -> DeepSpeedMethods:
    """A DeepSpeed accelerator answering through ``accelerator`` (default: the selected one).

    :raises BackendSelectionError: when no ds_core backend can be selected (before DeepSpeed
        is imported).
    """
    accelerator = accelerator if accelerator is not None else get_accelerator()
    return adapter_class()(accelerator)


def _install_into(real_accelerator: ModuleType) -> None:
    """Give DeepSpeed's accelerator module the adapter (called by the start hook)."""
    current = getattr(real_accelerator, "ds_accelerator", None)
    if isinstance(current, DeepSpeedMethods):
        return
    real_accelerator.set_accelerator(adapter())


class _InstallingLoader(importlib.abc.Loader):
    """Runs DeepSpeed's accelerator-selection module, then installs the adapter into it."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _install_into(module)


def find_real_accelerator_spec(
    fullname: str, path: Sequence[str] | None
) -> importlib.machinery.ModuleSpec | None:
    """The spec of DeepSpeed's ``real_accelerator`` module, with a loader that installs the
    adapter right after the module runs; ``None`` for any other module."""
    if fullname != _REAL:
        return None
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = _InstallingLoader(spec.loader)
    return spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return find_real_accelerator_spec(fullname, path)


def _import_deepspeed() -> None:
    """``import deepspeed`` with the adapter installed during it (see :func:`install`)."""
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        import deepspeed  # noqa: F401 - the finder installs the adapter during this import
    finally:
        sys.meta_path.remove(finder)


def install() -> DeepSpeedMethods:
    """Make DeepSpeed use the selected ds_core backend; returns the adapter DeepSpeed holds.

    Call it before ``import deepspeed`` when ``DS_ACCELERATOR`` names a backend DeepSpeed does
    not list: DeepSpeed is then imported here, and the adapter is in place before DeepSpeed's
    first accelerator lookup. Called after ``import deepspeed`` it replaces DeepSpeed's choice,
    but what DeepSpeed resolved at import (the builder classes bound in
    ``deepspeed.ops.op_builder``) stays DeepSpeed's.
    """
    if _REAL not in sys.modules:
        _import_deepspeed()
    real = sys.modules[_REAL]
    _install_into(real)
    installed: DeepSpeedMethods = real.ds_accelerator
    return installed


def hook_requested() -> bool:
    """Whether :data:`ENV_HOOK` asks for the start hook."""
    return os.environ.get(ENV_HOOK) == "1"
