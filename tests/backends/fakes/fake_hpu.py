"""A recorded fake of Intel Gaudi's ``habana_frameworks.torch`` stack, for contract tests.

Shaped after HabanaAI/gaudi-pytorch-bridge ``python_packages/habana_frameworks/torch``:
``hpu/__init__.py`` (``synchronize()`` without a device, ``get_device_properties`` returning a
string, ``is_bf16_supported``), ``hpu/random.py`` (one generator per process; indices other than
0 refused), ``hpu/memory.py`` (``memory_stats`` keys ``Limit``/``InUse``/``MaxInUse``,
``mem_get_info = (Limit - InUse, Limit)``), ``hpu/graphs.py`` (``HPUGraph``,
``graph(hpu_graph, stream=None, dry_run=False)``, exported in lazy mode only), ``core.mark_step``,
``utils.internal.is_lazy``, ``utils.experimental._is_fp16_supported``,
``distributed.hccl`` (imported for its side effect) and ``hpex.optimizers.FusedAdamW``.

:func:`install` puts the fake modules in ``sys.modules`` so ``importlib.import_module`` finds
them instead of the real (absent) stack.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from tests.backends.fakes.fake_device_module import FakeDeviceModule, GiB


class FakeHpu(FakeDeviceModule):
    """``habana_frameworks.torch.hpu`` driving one Gaudi module per process.

    :param lazy: what ``utils.internal.is_lazy()`` answers; graphs are exported only when true.
    :param fp16: what ``utils.experimental._is_fp16_supported()`` answers.
    :param mem_get_info: give the module ``mem_get_info`` (newer bridges have it).
    """

    def __init__(self, *, lazy: bool = False, fp16: bool = True, mem_get_info: bool = True) -> None:
        super().__init__("hpu", 1, total=96 * GiB, free=90 * GiB, name="GAUDI2")
        self.lazy = lazy
        self.fp16 = fp16
        self.has_mem_get_info = mem_get_info
        self.limit = 94 * GiB
        self.random = SimpleNamespace(
            manual_seed=lambda seed: self.log("random.manual_seed", seed),
            manual_seed_all=lambda seed: self.log("random.manual_seed_all", seed),
            get_rng_state=self._get_rng_state,
            set_rng_state=self._set_rng_state,
            default_generators=[torch.Generator()],
        )
        if lazy:
            self.add_graph_api("HPUGraph")

    # -- one device per process ----------------------------------------------------------------

    def synchronize(self) -> None:  # type: ignore[override]
        self.log("synchronize")

    def get_device_name(self, device: Any = None) -> str:
        self.log("get_device_name", device)
        return self.name

    def get_device_properties(self, device: Any = None) -> str:  # type: ignore[override]
        self.log("get_device_properties", device)
        return "(sramBaseAddress=1153202979533225984, dramBaseAddress=1153203082662772736)"

    def get_device_capability(self) -> str:
        self.log("get_device_capability")
        return "1.19.0"

    def is_bf16_supported(self) -> bool:
        self.log("is_bf16_supported")
        return True

    def _index(self, device: Any) -> int:
        return 0 if device in (None, "hpu") else int(str(device).rsplit(":", 1)[-1])

    def _get_rng_state(self, device: Any = "hpu") -> torch.Tensor:
        self.log("random.get_rng_state", device)
        if self._index(device) != 0:
            raise RuntimeError("hpu get_rng_state supports only device 0")
        return torch.zeros(16, dtype=torch.uint8)

    def _set_rng_state(self, new_state: torch.Tensor, device: Any = "hpu") -> None:
        self.log("random.set_rng_state", new_state, device)
        if self._index(device) != 0:
            raise RuntimeError("hpu set_rng_state supports only device 0")

    # -- the bridge's allocator statistics -------------------------------------------------------

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        self.log("memory_stats", device)
        return {
            "Limit": self.limit,
            "InUse": self.allocated,
            "MaxInUse": self.allocated + GiB,
            "NumAllocs": 12,
            "NumFrees": 3,
        }

    def memory_reserved(self, device: Any = None) -> int:
        self.log("memory_reserved", device)
        return self.limit

    @property
    def mem_get_info(self) -> Callable[..., tuple[int, int]]:  # type: ignore[override]
        if not self.has_mem_get_info:
            raise AttributeError("mem_get_info")  # older bridges lack it

        def mem_get_info(device: Any = None) -> tuple[int, int]:
            self.log("mem_get_info", device)
            return self.limit - self.allocated, self.limit

        return mem_get_info


class FakeFusedAdamW:
    """``hpex.optimizers.FusedAdamW``: records the arguments it was built with."""

    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, params: Any, **kwargs: Any) -> None:
        FakeFusedAdamW.built.append(kwargs)
        self.params = list(params)


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeHpu) -> dict[str, ModuleType]:
    """Put ``fake`` and the rest of the fake stack in ``sys.modules``; return the modules."""

    def mark_step() -> None:
        fake.log("core.mark_step")

    def is_lazy() -> bool:
        return fake.lazy

    def is_fp16_supported() -> bool:
        fake.log("experimental._is_fp16_supported")
        return fake.fp16

    FakeFusedAdamW.built = []
    modules = {
        "habana_frameworks": ModuleType("habana_frameworks"),
        "habana_frameworks.torch": ModuleType("habana_frameworks.torch"),
        "habana_frameworks.torch.core": ModuleType("habana_frameworks.torch.core"),
        "habana_frameworks.torch.utils.internal": ModuleType("internal"),
        "habana_frameworks.torch.utils.experimental": ModuleType("experimental"),
        "habana_frameworks.torch.distributed.hccl": ModuleType("hccl"),
        "habana_frameworks.torch.hpex.optimizers": ModuleType("optimizers"),
    }
    modules["habana_frameworks.torch.core"].mark_step = mark_step  # type: ignore[attr-defined]
    modules["habana_frameworks.torch.utils.internal"].is_lazy = is_lazy  # type: ignore[attr-defined]
    modules["habana_frameworks.torch.utils.experimental"]._is_fp16_supported = is_fp16_supported  # type: ignore[attr-defined]
    modules["habana_frameworks.torch.hpex.optimizers"].FusedAdamW = FakeFusedAdamW  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.hpu", fake)
    return modules
