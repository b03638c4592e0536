"""DeepSpeed's op builders, answered by ds_core's op providers (docs/interop.md).

DeepSpeed loads compiled ops through builder classes (``CPUAdamBuilder().load()``). The adapter
in :mod:`ds_core.interop.deepspeed` answers a builder from here: one a ds_core op provider maps
to (:data:`PROVIDER_BUILDERS`) loads that provider, and one nothing provides loads into
:class:`OpNotAvailableError` naming the op and the backend, never a silent stand-in.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ds_core.accelerator import get_accelerator
from ds_core.errors import DSCoreError
from ds_core.types import OpProvider

#: DeepSpeed builder class name -> the ds_core op provider that answers it.
PROVIDER_BUILDERS: dict[str, str] = {"CPUAdamBuilder": "cpu_adam"}

#: Builders DeepSpeed's communication layer asks for and does without when they are absent
#: (it checks ``builder is None``): the adapter answers ``None`` for these when neither ds_core
#: nor DeepSpeed's builders for the device type provide them, as DeepSpeed's own accelerators
#: do. Every other missing builder is refused when loaded.
OPTIONAL_BUILDERS: frozenset[str] = frozenset({"ShareMemCommBuilder", "CCLCommBuilder"})


class OpNotAvailableError(DSCoreError):
    """No ds_core op provider and no DeepSpeed builder for this device type provides an op."""

    def __init__(self, op: str, backend: str, device_type: str) -> None:
        self.op = op
        self.backend = backend
        super().__init__(
            f"DeepSpeed op builder '{op}' is not available on ds_core backend '{backend}': no "
            f"ds_core op provider maps to it (mapped: {', '.join(sorted(PROVIDER_BUILDERS))}) and "
            f"DeepSpeed has no builder of that name for device type '{device_type}'. Use an "
            f"optimizer or op that does not need it (e.g. torch.optim.Adam)."
        )


class _CPUAdamModule:
    """DeepSpeed's compiled ``cpu_adam`` module interface over ds_core's ``cpu_adam`` kernel.

    ``deepspeed.ops.adam.DeepSpeedCPUAdam`` calls ``create_adam``, ``adam_update`` and
    ``destroy_adam`` on what ``CPUAdamBuilder().load()`` returns; these run ds_core's kernel.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._adamw: dict[int, bool] = {}

    def create_adam(
        self,
        opt_id: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw_mode: bool,
        should_log: bool = False,
    ) -> int:
        self._adamw[opt_id] = bool(adamw_mode)
        return 0

    def adam_update(
        self,
        opt_id: int,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        params: torch.Tensor,
        grads: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> int:
        self.kernel.step(
            params,
            grads,
            exp_avg,
            exp_avg_sq,
            lr=lr,
            betas=(beta1, beta2),
            eps=eps,
            weight_decay=weight_decay,
            step=int(step),
            bias_correction=bool(bias_correction),
            adamw_mode=self._adamw.get(opt_id, True),
        )
        return 0

    def adam_rollback(self, *args: Any) -> int:
        raise DSCoreError(
            "ds_core's cpu_adam has no rollback (DeepSpeed's SuperOffload step rollback); "
            "turn SuperOffload off or use DeepSpeed's own CPU accelerator"
        )

    def destroy_adam(self, opt_id: int) -> int:
        self._adamw.pop(opt_id, None)
        return 0


def _cpu_adam_module(provider: OpProvider) -> _CPUAdamModule:
    optimizer_class = provider.load()  # builds the kernel now, as DeepSpeed's load() does
    return _CPUAdamModule(optimizer_class([torch.zeros(1)]).kernel)


class _ProviderBuilder:
    """A DeepSpeed-style op builder whose ``load()`` runs a ds_core op provider."""

    NAME = ""
    BUILDER = ""

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return f"ds_core.ops.{self.NAME}"

    def _provider(self) -> OpProvider:
        return get_accelerator().get_op(PROVIDER_BUILDERS[self.BUILDER])

    def is_compatible(self, verbose: bool = False) -> bool:
        return bool(self._provider().is_compatible()[0])

    def load(self, verbose: bool = True) -> Any:
        provider = self._provider()
        ok, reason = provider.is_compatible()
        if not ok:
            raise DSCoreError(f"ds_core op '{provider.name}' cannot load here: {reason}")
        if self.BUILDER == "CPUAdamBuilder":
            return _cpu_adam_module(provider)
        return provider.load()  # pragma: no cover - only CPUAdamBuilder is mapped today

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)


class _RefusedBuilder:
    """A builder nothing provides: constructible (DeepSpeed lists every builder at import),
    never compatible, and ``load()`` raises :class:`OpNotAvailableError`."""

    NAME = ""
    BUILDER = ""
    BACKEND = ""
    DEVICE_TYPE = ""

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return f"ds_core.refused.{self.NAME}"

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True) -> Any:
        raise OpNotAvailableError(self.BUILDER, self.BACKEND, self.DEVICE_TYPE)

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)


@functools.cache
def provider_builder(class_name: str) -> type[_ProviderBuilder]:
    op = PROVIDER_BUILDERS[class_name]
    return type(class_name, (_ProviderBuilder,), {"NAME": op, "BUILDER": class_name})


@functools.cache
def refused_builder(class_name: str, backend: str, device_type: str) -> type[_RefusedBuilder]:
    attrs = {
        "NAME": f"ds_core_refused_{class_name}",
        "BUILDER": class_name,
        "BACKEND": backend,
        "DEVICE_TYPE": device_type,
    }
    return type(class_name, (_RefusedBuilder,), attrs)
