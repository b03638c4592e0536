"""Check, from wheel metadata alone, that every ds-core extra names a backend wheel we built.

Usage: ``python tools/check_extras.py WHEEL_DIR``. Vendor extras are checked without
installing them (their vendor stacks would replace the CPU build of torch).
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

EXTRAS = {
    "cpu": "ds-core-cpu",
    "cuda": "ds-core-cuda",
    "rocm": "ds-core-rocm",
    "xpu": "ds-core-xpu",
    "hpu": "ds-core-hpu",
    "npu": "ds-core-npu",
    "kunlunxin": "ds-core-kunlunxin",
    "sim": "ds-core-sim",
    "conformance": "ds-core-conformance",
}

#: backend wheel -> the vendor package it must pull from a package index
VENDOR_REQUIRES = {"ds-core-npu": "torch-npu"}


def metadata(wheel: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(name).decode())
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def main(wheel_dir: str) -> int:
    built = {}
    requires_of: dict[str, list[str]] = {}
    core_requires: list[str] = []
    for wheel in Path(wheel_dir).glob("*.whl"):
        name, version, requires = metadata(wheel)
        built[name.lower().replace("_", "-")] = version
        requires_of[name.lower().replace("_", "-")] = requires
        if name == "ds-core":
            core_requires = requires
    problems = []
    for extra, dist in EXTRAS.items():
        pattern = re.compile(rf"^{re.escape(dist)}\b.*extra == \"{extra}\"")
        if not any(pattern.match(r) for r in core_requires):
            problems.append(f"ds-core's extra '{extra}' does not require {dist}")
        if dist not in built:
            problems.append(f"no wheel was built for {dist} (extra '{extra}')")
    # the vendor stack that comes from a package index is pulled by the backend's wheel
    for dist, vendor in VENDOR_REQUIRES.items():
        if not any(r.startswith(vendor) for r in requires_of.get(dist, [])):
            problems.append(f"{dist} does not require {vendor}")
    for p in problems:
        print("extras:", p)
    if not problems:
        print(f"extras: all {len(EXTRAS)} extras name a built wheel: {', '.join(sorted(built))}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
