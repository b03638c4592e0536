"""Capacity: ``ds_memory_info`` is coherent and honours the process's own limits (rlimits and
cgroups, v1 and v2), each imposed in a fresh interpreter. Part of the memory category, kept apart
from the allocation checks of test_memory.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ds_conformance.helpers import MiB, check, run_python
from ds_conformance.marks import capability, hooks, promise, tier

CATEGORY = "memory"
pytestmark = tier("basic")


@hooks("ds_memory_info")
@promise("ds_memory_info", "``total ≥ available > 0`` on a usable device.")
def test_total_at_least_available_above_zero(acc: Any) -> None:
    info = acc.memory_info()
    check(
        info.total >= info.available > 0,
        "(total, available)",
        (info.total, info.available),
        "total ≥ available > 0",
        "ds_memory_info",
    )
    if acc.device_type == "cpu":  # an independent measurement: the host's physical pages
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        check(
            info.total <= host and (info.limit is not None or info.total == host),
            "total",
            info.total,
            f"the host's {host} bytes, or less with a named limit",
            "ds_memory_info",
        )
    if info.limit is not None:
        check(
            info.total <= info.limit and bool(info.limit_source),
            "(total, limit, source)",
            (info.total, info.limit, info.limit_source),
            "total ≤ limit, with a source",
            "ds_memory_info",
        )


_LIMIT_SCRIPT = """
import json, resource, torch
from ds_core import get_accelerator
SOURCE, FIELD = {source!r}, {field!r}
def used():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                if l.startswith(FIELD + ":"))
acc = get_accelerator()
acc.memory_info()
before = used()
imposed = before + 512 * 2**20
_, hard = resource.getrlimit(getattr(resource, SOURCE))
resource.setrlimit(getattr(resource, SOURCE), (imposed, hard))
info = acc.memory_info()
after = used()
block = torch.ones(64 * 2**20 // 4)  # counts against both limits
grown = acc.memory_info()
print(json.dumps({{"imposed": imposed, "total": info.total, "available": info.available,
                  "limit": info.limit, "source": info.limit_source, "used_before": before,
                  "used_after": after, "available_after_64MiB": grown.available,
                  "used_after_64MiB": used()}}))
"""


@capability("memory_limits")
@hooks("ds_memory_info")
@pytest.mark.parametrize(("source", "field"), [("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")])
@promise(
    "ds_memory_info",
    "Return total and available device memory for this process, capped by its own limits.",
)
@promise(
    "ds_memory_info",
    "``total`` is never the host's or device's capacity when a lower per-process limit applies",
)
def test_values_follow_an_imposed_process_limit(acc: Any, source: str, field: str) -> None:
    """Impose ``source`` at current usage + 512 MiB; the figures must follow it exactly.

    ``limit`` equals the imposed bytes, ``total`` is capped at it, ``available`` is the limit
    minus what the process uses against it (≈ 512 MiB), and a 64 MiB allocation lowers it.
    """
    if acc.device_type != "cpu":
        pytest.skip("the suite can impose a process limit (rlimit) only on host memory")
    r = run_python(_LIMIT_SCRIPT.format(source=source, field=field))
    imposed = r["imposed"]
    if r["limit"] is not None and r["limit"] < imposed and source not in r["source"]:
        pytest.skip(f"a lower limit binds on this host ({r['source']}: {r['limit']} bytes)")
    call = f"setrlimit({source}, usage + 512 MiB); ds_memory_info"
    check(
        r["limit"] == imposed and source in r["source"],
        "(limit, limit_source)",
        (r["limit"], r["source"]),
        f"({imposed}, a source naming {source})",
        call,
    )
    check(r["total"] == imposed, "total", r["total"], f"{imposed} (the limit, in bytes)", call)
    low, high = imposed - r["used_after"] - 32 * MiB, imposed - r["used_before"] + 32 * MiB
    check(
        low <= r["available"] <= high,
        "available",
        r["available"],
        f"in [{low}, {high}]: the limit minus the process's {field}",
        call,
    )
    drop = r["available"] - r["available_after_64MiB"]
    grew = r["used_after_64MiB"] - r["used_after"]
    check(
        drop >= grew - 16 * MiB and drop >= 32 * MiB,
        "drop of available after a 64 MiB tensor",
        drop,
        f"≈ the {grew}-byte growth of {field}",
        call,
    )


# cgroup limits cannot be imposed on a running process without owning a cgroup hierarchy, so
# the child builds a private mount namespace and sees a fake one: a directory bind-mounted
# over /sys/fs/cgroup and a file over /proc/self/cgroup naming the process's cgroup. The
# mounts are private, so the host's own tree is untouched.
_CGROUP_SCRIPT = """
import ctypes, json, os, sys
TREE, PROC_CGROUP, USAGE, OVER = {tree!r}, {proc_cgroup!r}, {usage!r}, {over!r}
CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 4096, 16384, 262144
libc = ctypes.CDLL(None, use_errno=True)
def skip(why):
    print(json.dumps({{"skip": why}}))
    sys.exit(0)
if libc.unshare(CLONE_NEWNS) != 0:
    skip(f"unshare(CLONE_NEWNS): {{os.strerror(ctypes.get_errno())}} (needs CAP_SYS_ADMIN)")
if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
    skip(f"making / private: {{os.strerror(ctypes.get_errno())}}")
if not os.path.isdir("/sys/fs/cgroup"):
    skip("no /sys/fs/cgroup to mount the fake tree over")
for src, target in ((TREE, "/sys/fs/cgroup"), (PROC_CGROUP, "/proc/self/cgroup")):
    if libc.mount(src.encode(), target.encode(), None, MS_BIND, None) != 0:
        skip(f"bind mount over {{target}}: {{os.strerror(ctypes.get_errno())}}")
seen = open("/proc/self/cgroup").read()
from ds_core import get_accelerator
def host_available():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo")
                if l.startswith("MemAvailable:"))
acc = get_accelerator()
for _ in range(50):  # a reading the host's figure did not move across
    before = host_available()
    info = acc.memory_info()
    host = host_available()
    if host == before:
        break
with open(USAGE, "w") as f:  # the cgroup's usage falls to nothing; available must follow
    f.write("0\\n")
idle = acc.memory_info()
with open(USAGE, "w") as f:  # past its limit (reclaim can lag): nothing is left to allocate
    f.write(f"{{OVER}}\\n")
over = acc.memory_info()
print(json.dumps({{"seen": seen, "total": info.total, "available": info.available,
                  "limit": info.limit, "source": info.limit_source, "host_available": host,
                  "host_available_before": before,
                  "total_idle": idle.total, "available_idle": idle.available,
                  "available_over": over.available}}))
"""

#: the fake cgroup's limit and usage: page multiples, neither a power of two
CGROUP_LIMIT = 768 * MiB + 12 * 1024
CGROUP_USED = 288 * MiB + 4 * 1024
#: the fake cgroup of the process: containerd's systemd-driver paths hold colons
JOB = "job.slice:cri-containerd:0f3a"
#: limits where a misread /proc/self/cgroup leads (the v1 tree's decoys)
DECOY_LIMIT = 256 * MiB + 8 * 1024
# what cgroup v1 writes for "no limit": 2^63 - 1 rounded down to a page
_V1_NO_LIMIT = "9223372036854771712"


def _fake_cgroup_tree(root: Path, version: str, limit_at: str | None) -> tuple[Path, Path, Path]:
    """(tree, /proc/self/cgroup replacement, usage file) of a fake cgroup ``version`` tree.

    The process sits in ``/ds-conformance/job.slice:cri-containerd:0f3a`` (containerd's
    paths hold colons, as ``/proc/self/cgroup``'s separator); the limit is on that folder
    (``limit_at`` "job"), on its parent (``"parent"``: it binds the children too, as a
    Kubernetes pod's binds its containers) or nowhere (``None``). The hierarchy's root has no
    limit, so a backend that reads only the root, or the wrong version's files, sees none.
    The v1 tree is a hybrid host's: another controller's hierarchy lists the process first,
    under another path, and the unified line names a third. A lower decoy limit sits where a
    backend would look that took the first line's path for the memory controller's, or a v1
    line's path for the unified hierarchy's.
    """
    tree = root / "cgroup"
    if version == "v2":
        base, limit_file, usage_file = tree, "memory.max", "memory.current"
        proc = f"0::/ds-conformance/{JOB}\n"
        no_limit = "max"
    else:
        base, limit_file, usage_file = (
            tree / "memory",
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
        proc = (
            "3:cpu,cpuacct:/ds-conformance/cpu-only\n"
            f"4:memory:/ds-conformance/{JOB}\n"
            "0::/ds-conformance/unified\n"
        )
        no_limit = _V1_NO_LIMIT
        for decoy in (base / "ds-conformance" / "cpu-only", tree / "ds-conformance" / JOB):
            decoy.mkdir(parents=True)
            name = limit_file if decoy.is_relative_to(base) else "memory.max"
            (decoy / name).write_text(f"{DECOY_LIMIT}\n")
    job = base / "ds-conformance" / JOB
    job.mkdir(parents=True)
    (base / limit_file).write_text(no_limit + "\n")
    (base / usage_file).write_text(f"{4 * CGROUP_LIMIT}\n")
    limited = {"job": job, "parent": job.parent}.get(limit_at or "")
    for folder in (job.parent, job):
        bound = folder == limited
        (folder / limit_file).write_text(f"{CGROUP_LIMIT if bound else no_limit}\n")
        # another usage in the other folder: pairing the limit with it is off by 64 MiB
        (folder / usage_file).write_text(f"{CGROUP_USED if bound else CGROUP_USED - 64 * MiB}\n")
    proc_file = root / "proc-self-cgroup"
    proc_file.write_text(proc)
    return tree, proc_file, (limited or job) / usage_file


@capability("memory_limits")
@hooks("ds_memory_info")
@pytest.mark.parametrize(
    "limit_at", ["job", "parent", None], ids=["limited", "parent-limited", "unlimited"]
)
@pytest.mark.parametrize("version", ["v2", "v1"], ids=["cgroup-v2", "cgroup-v1"])
@promise("ds_memory_info", "``available`` is 0, never negative, once a limit's usage reaches it.")
def test_values_follow_an_imposed_cgroup_limit(
    acc: Any, tmp_path: Path, version: str, limit_at: str | None
) -> None:
    """A fake cgroup ``version`` tree limits the process; the figures must follow it exactly.

    Limited (on the process's cgroup or on its parent): ``limit`` and ``total`` equal the
    cgroup's limit, ``available`` is the limit minus that cgroup's usage, and follows the
    usage when it changes (0 once the usage passes the limit). Unlimited (v2 ``max``, v1's page-rounded 2^63): no cgroup limit is
    reported, and with no other limit ``total`` is the host's memory and ``available`` the
    kernel's ``MemAvailable``. Skipped where the process may not create a mount namespace (not
    root, or no ``/sys/fs/cgroup``).
    """
    if acc.device_type != "cpu":
        pytest.skip("the suite can impose a cgroup limit only on host memory")
    tree, proc_file, usage = _fake_cgroup_tree(tmp_path, version, limit_at)
    r = run_python(
        _CGROUP_SCRIPT.format(
            tree=str(tree), proc_cgroup=str(proc_file), usage=str(usage), over=CGROUP_LIMIT + 4096
        )
    )
    if "skip" in r:
        pytest.skip(f"cannot mount a fake cgroup tree: {r['skip']}")
    call = (
        f"fake cgroup {version} tree, limit {CGROUP_LIMIT if limit_at else 'none'}"
        f"{f' on the {limit_at}' if limit_at else ''}; ds_memory_info"
    )
    check(r["seen"] == proc_file.read_text(), "/proc/self/cgroup", r["seen"], "the fake", call)
    source = r["source"] or ""
    if limit_at is None:
        check(
            "cgroup" not in source,
            "(limit, limit_source)",
            (r["limit"], source),
            "no cgroup limit (the tree says unlimited)",
            call,
        )
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if r["limit"] is None:
            check(r["total"] == host, "total", r["total"], f"the host's {host} bytes", call)
            # nothing limits the process: it may have what the host has available
            low, high = sorted((r["host_available_before"], r["host_available"]))
            check(
                low <= r["available"] <= high,
                "available",
                r["available"],
                f"the host's MemAvailable, read around the call ({low} to {high} bytes)",
                call,
            )
        return
    if r["limit"] is not None and r["limit"] < CGROUP_LIMIT and "cgroup" not in source:
        pytest.skip(f"a lower limit binds on this host ({source}: {r['limit']} bytes)")
    if r["host_available"] < 2 * CGROUP_LIMIT:
        pytest.skip(f"the host has only {r['host_available']} bytes available")
    check(
        r["limit"] == CGROUP_LIMIT and "cgroup" in source,
        "(limit, limit_source)",
        (r["limit"], source),
        f"({CGROUP_LIMIT}, a source naming the cgroup)",
        call,
    )
    check(
        r["total"] == CGROUP_LIMIT,
        "total",
        r["total"],
        f"{CGROUP_LIMIT} (the limit, in bytes)",
        call,
    )
    want = CGROUP_LIMIT - CGROUP_USED
    check(
        r["available"] == want,
        "available",
        r["available"],
        f"{want}: the limit minus the cgroup's usage",
        call,
    )
    check(
        (r["total_idle"], r["available_idle"]) == (CGROUP_LIMIT, CGROUP_LIMIT),
        "(total, available) after the cgroup's usage fell to 0",
        (r["total_idle"], r["available_idle"]),
        f"({CGROUP_LIMIT}, {CGROUP_LIMIT}): available follows the usage",
        call,
    )
    check(
        r["available_over"] == 0,
        "available once the cgroup's usage passed its limit",
        r["available_over"],
        "0 (never negative)",
        call,
    )
