"""Whether this host can run the Huawei Ascend backend, answered without initialising an NPU.

Importing torch_npu renames torch's PrivateUse1 backend, registers devices and process groups
and refuses to load next to another accelerator build, so the probe does not import it. It asks:

1. whether ``torch_npu`` is installed (``find_spec``, no import);
2. the Ascend driver's device count, ``drvGetDevNum`` in ``libascend_hal.so`` (the call
   torch_npu itself makes before initialising ACL), narrowed by ``ASCEND_RT_VISIBLE_DEVICES``
   with torch_npu's own rules.
"""

from __future__ import annotations

import ctypes
import os

from ds_core.backend_kit import ProbeCache, module_present
from ds_core.types import ProbeResult

VENDOR_PACKAGE = "torch_npu"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
HAL_LIBRARY = "libascend_hal.so"
#: torch_npu's bound on device ids when the mask is unset.
MAX_DEVICES = 64

DRIVER_HINT = (
    "install the Ascend driver and firmware (`npu-smi info` should list the NPUs) and source "
    "the CANN toolkit's set_env.sh"
)


def hal_device_count() -> tuple[int | None, str]:
    """NPUs the driver reports, or ``None`` with the reason when it cannot answer."""
    try:
        hal = ctypes.CDLL(HAL_LIBRARY)
    except OSError as exc:
        return None, f"the Ascend driver library could not be loaded ({exc})"
    count = ctypes.c_int(-1)
    rc = hal.drvGetDevNum(ctypes.byref(count))
    if rc != 0:
        return None, f"the Ascend driver's drvGetDevNum failed (error {rc})"
    return count.value, "the Ascend driver (drvGetDevNum)"


def visible_count(found: int) -> int:
    """NPUs left visible by ``ASCEND_RT_VISIBLE_DEVICES``, by torch_npu's rules.

    Only digits and commas are read (reading stops at any other character); an empty entry
    ends the list; ids must be strictly ascending or nothing is visible; the list is cut at the
    first id the driver does not have. Unset means every device.
    """
    value = os.environ.get(VISIBLE_DEVICES_ENV)
    if value is None:
        return min(found, MAX_DEVICES)
    digits = ""
    for char in value:
        if not (char.isdigit() or char == ","):
            break
        digits += char
    ids: list[int] = []
    for entry in digits.split(",") if digits else []:
        if not entry:
            break
        ids.append(int(entry))
    for position, device in enumerate(ids):
        if position > 0 and device <= ids[position - 1]:
            return 0
        if device >= found:
            return position
    return len(ids)


def _probe_uncached() -> ProbeResult:
    if not module_present(VENDOR_PACKAGE):
        return ProbeResult(
            False,
            'torch_npu is not installed; pip install "ds-core[npu]" (it needs Huawei\'s CANN '
            "toolkit and Ascend driver, installed from Huawei's packages)",
        )
    found, how = hal_device_count()
    if found is None:
        return ProbeResult(False, f"torch_npu is installed but {how}; {DRIVER_HINT}")
    count = visible_count(found)
    if count == 0:
        mask = os.environ.get(VISIBLE_DEVICES_ENV)
        masked = (
            f" visible with {VISIBLE_DEVICES_ENV}={mask!r} (ids must be ascending and below "
            f"{found})"
            if mask is not None
            else ""
        )
        return ProbeResult(
            False,
            f"torch_npu is installed but {how} reports {found} NPU(s), none{masked}; "
            + (f"fix {VISIBLE_DEVICES_ENV}" if masked else DRIVER_HINT),
        )
    return ProbeResult(True, f"{count} Ascend NPU(s) found by {how}", count)


#: The probe, run once per process (again in a forked child).
probe = ProbeCache(_probe_uncached)
