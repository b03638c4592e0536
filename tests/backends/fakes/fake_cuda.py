"""A recorded fake of ``torch.cuda``, for contract tests of the cuda, rocm and kunlunxin backends.

Shaped after torch's ``torch/cuda/__init__.py``, ``memory.py``, ``random.py`` and ``graphs.py``:
``get_device_capability()``, ``is_bf16_supported(including_emulation=True)``,
``get_per_process_memory_fraction(device)``, ``is_initialized()``, ``CUDAGraph`` and
``graph(cuda_graph, pool=, stream=, capture_error_mode=)``. :func:`install` puts it on ``torch``
together with the build facts the probes read (``torch.version.cuda`` / ``torch.version.hip``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

# torch.use_deterministic_algorithms imports this lazily, and the import reads torch.cuda's
# public API; importing it now, with the real torch.cuda, keeps that out of the fake's record.
import torch._inductor.config

from tests.backends.fakes.fake_device_module import FakeDeviceModule, GiB

#: The real module, for torch's own lookups of private names while the fake is installed.
_REAL_CUDA = torch.cuda


class FakeCuda(FakeDeviceModule):
    """``torch.cuda`` of a build with ``count`` devices.

    :param capability: what ``get_device_capability()`` answers (major, minor).
    :param bf16: what ``is_bf16_supported`` answers (for either ``including_emulation``).
    :param fraction: give the module ``get_per_process_memory_fraction`` returning it.
    :param arch: ``gcnArchName`` of the device properties (ROCm builds), or ``None``.
    :param graphs: give the module ``CUDAGraph`` and ``graph``.
    """

    def __init__(
        self,
        count: int = 2,
        *,
        capability: tuple[int, int] = (9, 0),
        bf16: bool = True,
        fraction: float | None = None,
        arch: str | None = None,
        graphs: bool = True,
        name: str = "NVIDIA H200",
    ) -> None:
        props: dict[str, Any] = {
            "major": capability[0],
            "minor": capability[1],
            "multi_processor_count": 132,
        }
        if arch is not None:
            props["gcnArchName"] = arch
        self.initialized = False  # before the base class stores default_generators
        super().__init__("cuda", count, total=140 * GiB, free=100 * GiB, name=name, props=props)
        self.capability = capability
        self.bf16 = bf16
        if fraction is not None:
            self.add_memory_fraction(fraction)
        if graphs:
            self.add_graph_api("CUDAGraph", "graph")
        # torch.cuda.nvtx.range_push/range_pop (what Nsight Systems shows), recorded.
        self.nvtx = SimpleNamespace(
            range_push=lambda msg: self.log("nvtx.range_push", msg) or 0,
            range_pop=lambda: self.log("nvtx.range_pop") or 0,
        )

    def __getattr__(self, name: str) -> Any:
        # torch internals (dynamo, inductor) read private names such as _CudaDeviceProperties
        # while a test has the fake installed; public API stays fake-only, so a backend that
        # calls something the fake lacks fails instead of reaching the real module.
        if name.startswith("_") and not name.startswith("__"):
            return getattr(_REAL_CUDA, name)
        raise AttributeError(f"fake torch.cuda has no attribute {name!r}")

    # torch.cuda initialises its runtime lazily: these calls do it, and default_generators
    # stays empty until then (as in torch), so a backend indexing it too early fails here.

    @property  # type: ignore[override]
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return self._generators if self.initialized else ()

    @default_generators.setter
    def default_generators(self, value: tuple[torch.Generator, ...]) -> None:
        self._generators = value

    def _lazy_init(self) -> None:
        self.initialized = True

    def current_device(self) -> int:
        self._lazy_init()
        return super().current_device()

    def synchronize(self, device: Any = None) -> None:
        self._lazy_init()
        super().synchronize(device)

    def get_device_properties(self, index: int) -> Any:
        self._lazy_init()
        return super().get_device_properties(index)

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        self._lazy_init()
        return super().get_rng_state(device)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._lazy_init()
        return super().mem_get_info(device)

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        self.log("get_device_capability", device)
        return self.capability

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        self.log("is_bf16_supported", including_emulation=including_emulation)
        return self.bf16

    def is_initialized(self) -> bool:
        return self.initialized


def install(
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeCuda,
    *,
    cuda: str | None = "12.8",
    hip: str | None = None,
) -> FakeCuda:
    """Make ``torch.cuda`` the fake and set the build facts ``torch.version.cuda``/``.hip``."""
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    return fake
