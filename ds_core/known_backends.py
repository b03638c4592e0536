"""Backends ds_core knows by name: pip extra, distribution and torch device type.

Used only by ``ds-core report`` and error messages (to tell a user what to install); selection
never consults this table, so an unknown third-party backend works the same way.
"""

from __future__ import annotations

from typing import Final, NamedTuple


class KnownBackend(NamedTuple):
    name: str
    distribution: str
    extra: str
    device_type: str
    comm_backend: str
    vendor: str


KNOWN_BACKENDS: Final[dict[str, KnownBackend]] = {
    b.name: b
    for b in (
        KnownBackend("cuda", "ds-core-cuda", "cuda", "cuda", "nccl", "NVIDIA GPUs"),
        KnownBackend("rocm", "ds-core-rocm", "rocm", "cuda", "nccl (RCCL)", "AMD GPUs"),
        KnownBackend("xpu", "ds-core-xpu", "xpu", "xpu", "xccl", "Intel GPUs"),
        KnownBackend("hpu", "ds-core-hpu", "hpu", "hpu", "hccl", "Intel Gaudi"),
        KnownBackend("npu", "ds-core-npu", "npu", "npu", "hccl", "Huawei Ascend"),
        KnownBackend(
            "kunlunxin", "ds-core-kunlunxin", "kunlunxin", "cuda", "nccl (BKCL)", "Baidu Kunlunxin"
        ),
        KnownBackend("cpu", "ds-core-cpu", "cpu", "cpu", "gloo", "host CPU"),
        KnownBackend("sim", "ds-core-sim", "sim", "sim", "simccl", "simulated accelerator"),
    )
}


def install_hint(name: str) -> str:
    """Return the pip command that installs backend ``name``, or ``""`` when unknown."""
    known = KNOWN_BACKENDS.get(name)
    return f'pip install "ds-core[{known.extra}]"' if known else ""
