"""A recorded fake of ``torch.xpu`` (Intel GPUs in PyTorch's XPU builds), for contract tests.

Shaped after torch 2.13's ``torch/xpu/__init__.py``, ``memory.py``, ``streams.py`` and
``graphs.py``: a compile-time ``_is_compiled()``, the fork-safe Level Zero Sysman count
``_device_count_zes()`` (-1 when Sysman cannot answer), ``is_bf16_supported(including_emulation)``,
properties with ``has_fp16``/``has_fp64``/``has_bfloat16_conversions``, streams carrying
``device_index``, ``XPUGraph`` with ``graph(xpu_graph, pool=, stream=)``, and no
``default_stream`` (torch.xpu has none). Install it with ``monkeypatch.setattr(torch, "xpu", fake)``.
"""

from __future__ import annotations

from typing import Any

from tests.backends.fakes.fake_device_module import FakeDeviceModule, FakeStream, GiB


class FakeXpu(FakeDeviceModule):
    """``torch.xpu`` of an XPU build with ``count`` GPUs (or of a CPU-only build).

    :param compiled: what ``_is_compiled()`` reports (``False``: a torch without XPU support).
    :param zes_count: what ``_device_count_zes()`` answers; ``None`` leaves it out (torch < 2.13).
    :param native_bf16: whether bf16 conversions are native (emulation is always reported).
    :param graphs: give the module ``XPUGraph`` and ``graph``.
    :param fraction: give the module ``get_per_process_memory_fraction`` returning it.
    :param initialised: ``False`` makes ``memory_stats()`` return ``{}``, as before runtime init.
    """

    def __init__(
        self,
        count: int = 2,
        *,
        compiled: bool = True,
        zes_count: int | None = None,
        native_bf16: bool = True,
        fp16: bool = True,
        fp64: bool = True,
        graphs: bool = True,
        fraction: float | None = None,
        initialised: bool = True,
    ) -> None:
        super().__init__(
            "xpu",
            count,
            total=64 * GiB,
            free=48 * GiB,
            name="Intel(R) Data Center GPU Max 1550",
            props={
                "has_fp16": fp16,
                "has_fp64": fp64,
                "has_bfloat16_conversions": native_bf16,
                "driver_version": "1.3.30049",
                "gpu_eu_count": 448,
            },
        )
        self.compiled = compiled
        self.native_bf16 = native_bf16
        self.initialised = initialised
        for i, stream in enumerate(self._default_streams):
            stream.device_index = i  # type: ignore[attr-defined]
        if zes_count is not None:
            self._zes_count = zes_count
            self._device_count_zes = self._count_zes
        if graphs:
            self.add_graph_api("XPUGraph")
        if fraction is not None:
            self.add_memory_fraction(fraction)

    def _is_compiled(self) -> bool:
        self.log("_is_compiled")
        return self.compiled

    def _count_zes(self) -> int:
        self.log("_device_count_zes")
        return self._zes_count

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        self.log("is_bf16_supported", including_emulation=including_emulation)
        return True if including_emulation else self.native_bf16

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802
        stream = super().Stream(device=device, priority=priority)
        index = self.current if device is None else int(str(device).rsplit(":", 1)[-1])
        stream.device_index = index  # type: ignore[attr-defined]
        return stream

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        if not self.initialised:
            self.log("memory_stats", device)
            return {}
        return super().memory_stats(device)

    @property
    def default_stream(self) -> Any:
        raise AttributeError("torch.xpu has no default_stream")
