"""Whether this host can run the Intel GPU backend, answered without initialising the GPU.

``torch.xpu.device_count()`` enumerates SYCL devices, which initialises the Level Zero runtime
and makes a later ``fork()`` unsafe, unless Level Zero Sysman (the ``pyzes`` package) answers
first. So the probe asks, in order:

1. whether this torch was built with XPU support (a compile-time flag, no runtime call);
2. Level Zero Sysman through torch's own ``_device_count_zes`` when ``pyzes`` is installed
   (it honours ``ZE_AFFINITY_MASK`` and ``ZE_FLAT_DEVICE_HIERARCHY`` exactly as torch will);
3. otherwise the kernel: PCI functions bound to Intel's GPU drivers (``i915``, ``xe``), narrowed
   by ``ZE_AFFINITY_MASK``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ds_core.backend_kit import (
    ProbeCache,
    count_device_nodes,
    dist_version,
    module_present,
    visible_device_count,
)
from ds_core.types import ProbeResult

#: Where Linux lists the PCI functions bound to Intel's GPU kernel drivers (i915: Gen9 to
#: Alchemist; xe: Battlemage, Lunar Lake and newer, and Ponte Vecchio/Arc when opted in).
INTEL_GPU_DRIVER_NODES = ("/sys/bus/pci/drivers/i915/*:*", "/sys/bus/pci/drivers/xe/*:*")

VISIBLE_DEVICES_ENV = "ZE_AFFINITY_MASK"

XPU_TORCH_HINT = (
    "install a torch build with XPU support, e.g. "
    "pip install torch --index-url https://download.pytorch.org/whl/xpu"
)


def xpu_compiled(xpu: Any) -> bool:
    """Whether torch was built with XPU support: a compile-time flag, no runtime call."""
    is_compiled = getattr(xpu, "_is_compiled", None)
    return bool(is_compiled()) if is_compiled is not None else False


def _sysman_count(xpu: Any) -> int:
    """Visible devices per Level Zero Sysman, or -1 when Sysman cannot answer.

    ``_device_count_zes`` appeared in torch 2.13 (pytorch/pytorch#178496); older releases have
    no fork-safe count, and a missing ``pyzes`` makes it answer -1.
    """
    count_zes = getattr(xpu, "_device_count_zes", None)
    if count_zes is None or not module_present("pyzes"):
        return -1
    return int(count_zes())


def _kernel_count() -> int:
    """Intel GPUs bound to a kernel driver, narrowed by ``ZE_AFFINITY_MASK``.

    UNCONFIRMED: this counts PCI functions, so a multi-tile card that torch exposes as one
    device per tile (``ZE_FLAT_DEVICE_HIERARCHY=FLAT``, the default) counts once here, and an
    integrated GPU counts even where torch prefers the discrete ones. The count only decides
    availability; after selection ``ds_device_count`` asks torch.
    """
    found = sum(count_device_nodes(pattern) for pattern in INTEL_GPU_DRIVER_NODES)
    return visible_device_count([VISIBLE_DEVICES_ENV], found)


def _probe_uncached() -> ProbeResult:
    xpu = torch.xpu
    torch_version = dist_version("torch") or torch.__version__
    if not xpu_compiled(xpu):
        ipex = (
            " (intel_extension_for_pytorch is installed, but cannot add XPU support to a torch "
            "built without it)"
            if module_present("intel_extension_for_pytorch")
            else ""
        )
        return ProbeResult(
            False, f"torch {torch_version} was built without XPU support{ipex}; {XPU_TORCH_HINT}"
        )
    imported: tuple[str, ...] = ()
    count = _sysman_count(xpu)
    if count >= 0:
        imported, how = ("pyzes",), "Level Zero Sysman (pyzes)"
    else:
        count, how = _kernel_count(), "the i915/xe kernel drivers"
    if count == 0:
        mask = os.environ.get(VISIBLE_DEVICES_ENV)
        masked = f" with {VISIBLE_DEVICES_ENV}={mask!r}" if mask is not None else ""
        return ProbeResult(
            False,
            f"torch {torch_version} has XPU support but {how} found no Intel GPU{masked}; "
            f"check the GPU driver (Level Zero) with `sycl-ls` or `xpu-smi discovery`"
            + (f", and {VISIBLE_DEVICES_ENV}" if masked else ""),
            0,
            imported,
        )
    return ProbeResult(True, f"{count} Intel GPU(s) found by {how}", count, imported)


#: The probe, run once per process (again in a forked child).
probe = ProbeCache(_probe_uncached)
