"""A recorded fake of Huawei Ascend's ``torch_npu``, for contract tests.

Shaped after Ascend/pytorch ``torch_npu/npu/__init__.py`` (``set_deterministic_level``,
``mem_get_info`` as ``(free, total)``, no per-process memory-fraction getter),
``torch_npu/npu/utils.py`` (``is_bf16_supported``), ``torch_npu/npu/graphs.py`` (``NPUGraph``,
``graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
capture_error_mode="global")``) and ``torch_npu/optim/npu_fused_adamw.py`` (``NpuFusedAdamW``).

:func:`install` puts a fake ``torch_npu`` package (``.npu`` = the fake device module) and the
fused-optimizer module in ``sys.modules``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch

from tests.backends.fakes.fake_device_module import FakeDeviceModule, GiB


class FakeNpu(FakeDeviceModule):
    """``torch_npu.npu`` with ``count`` NPUs.

    :param bf16: what ``is_bf16_supported()`` answers.
    :param deterministic_level: give the module ``set_deterministic_level`` (torch_npu ≥ 2.x).
    """

    def __init__(self, count: int = 8, *, bf16: bool = True, deterministic_level: bool = True):
        super().__init__(
            "npu",
            count,
            total=64 * GiB,
            free=61 * GiB,
            name="Ascend910B2",
            props={"cube_core_num": 24, "vector_core_num": 48, "L2_cache_size": 192 << 20},
        )
        self.bf16 = bf16
        self.level = 0
        if deterministic_level:
            self.set_deterministic_level = self._set_deterministic_level
        self.add_graph_api("NPUGraph")

    def is_bf16_supported(self) -> bool:
        self.log("is_bf16_supported")
        return self.bf16

    def _set_deterministic_level(self, level: int) -> None:
        # torch_npu keeps torch's flag equal to (level >= 1).
        self.log("set_deterministic_level", level)
        self.level = level
        torch.use_deterministic_algorithms(level >= 1)


class FakeNpuFusedAdamW:
    """``NpuFusedAdamW(params, lr, betas, eps, weight_decay, amsgrad)``: records its arguments."""

    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, params: Any, **kwargs: Any) -> None:
        FakeNpuFusedAdamW.built.append(kwargs)
        self.params = list(params)


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeNpu) -> ModuleType:
    """Put a fake ``torch_npu`` (``.npu`` = ``fake``) in ``sys.modules``; return it."""
    torch_npu = ModuleType("torch_npu")
    torch_npu.npu = fake  # type: ignore[attr-defined]
    fused = ModuleType("torch_npu.optim.npu_fused_adamw")
    fused.NpuFusedAdamW = FakeNpuFusedAdamW  # type: ignore[attr-defined]
    FakeNpuFusedAdamW.built = []
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setitem(sys.modules, "torch_npu.optim.npu_fused_adamw", fused)
    return torch_npu
