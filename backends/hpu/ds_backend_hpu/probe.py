"""Whether this host can run the Intel Gaudi backend, answered without acquiring a Gaudi.

Which ``habana_frameworks`` calls acquire a device is not documented (UNCONFIRMED), so the probe
imports none of it. It asks, in order:

1. whether ``habana_frameworks`` is installed (``find_spec``, no import);
2. ``hl-smi -Q module_id -f csv`` (Habana's management tool, run in its own process) for the
   modules present, narrowed by ``HABANA_VISIBLE_MODULES``;
3. when hl-smi is missing or fails, the PCI functions bound to the ``habanalabs`` kernel driver.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ds_core.backend_kit import (
    ProbeCache,
    count_device_nodes,
    module_present,
    visible_device_count,
)
from ds_core.types import ProbeResult

VENDOR_PACKAGE = "habana_frameworks"
VISIBLE_DEVICES_ENV = "HABANA_VISIBLE_MODULES"
HL_SMI = "hl-smi"
#: UNCONFIRMED as a Gaudi count: PCI functions bound to the upstream Linux driver
#: (drivers/accel/habanalabs), one per Gaudi module.
DRIVER_NODES = "/sys/bus/pci/drivers/habanalabs/[0-9a-f]*:*"
HL_SMI_TIMEOUT_S = 30

STACK_HINT = (
    "the Intel Gaudi software stack (driver, habana_frameworks and Habana's torch) comes from "
    "Intel Gaudi's installer or Docker images (https://docs.habana.ai), not from pip; "
    'pip install "ds-core[hpu]" installs only this backend'
)


def hl_smi_module_ids() -> tuple[list[int] | None, str]:
    """Module ids hl-smi lists, or ``None`` with the reason when it cannot answer."""
    exe = shutil.which(HL_SMI)
    if exe is None:
        return None, f"{HL_SMI} is not on PATH"
    try:
        out = subprocess.run(
            [exe, "-Q", "module_id", "-f", "csv"],
            capture_output=True,
            text=True,
            timeout=HL_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{HL_SMI} failed: {exc}"
    if out.returncode != 0:
        return None, f"{HL_SMI} exited {out.returncode}: {out.stderr.strip()[:200]}"
    # csv output: a "module_id" header, then one id per module.
    return [int(line) for line in out.stdout.split() if line.strip().isdigit()], HL_SMI


def _visible(module_ids: list[int]) -> int:
    """How many of ``module_ids`` ``HABANA_VISIBLE_MODULES`` leaves visible (all when unset)."""
    mask = os.environ.get(VISIBLE_DEVICES_ENV)
    if mask is None:
        return len(module_ids)
    wanted = {int(v) for v in mask.split(",") if v.strip().isdigit()}
    return len(wanted & set(module_ids))


def _probe_uncached() -> ProbeResult:
    if not module_present(VENDOR_PACKAGE):
        return ProbeResult(False, f"{VENDOR_PACKAGE} is not installed: {STACK_HINT}")
    ids, how = hl_smi_module_ids()
    if ids is not None:
        count = _visible(ids)
    else:
        found = count_device_nodes(DRIVER_NODES)
        count = visible_device_count([VISIBLE_DEVICES_ENV], found)
        how = f"the habanalabs kernel driver ({how})"
    if count == 0:
        mask = os.environ.get(VISIBLE_DEVICES_ENV)
        masked = f" with {VISIBLE_DEVICES_ENV}={mask!r}" if mask is not None else ""
        return ProbeResult(
            False,
            f"{VENDOR_PACKAGE} is installed but {how} found no Gaudi module{masked}; check the "
            f"driver with `{HL_SMI}`" + (f" and {VISIBLE_DEVICES_ENV}" if masked else ""),
        )
    return ProbeResult(True, f"{count} Gaudi module(s) found by {how}", count)


#: The probe, run once per process (again in a forked child).
probe = ProbeCache(_probe_uncached)
