"""Arrival flags in a shared segment: the C helper, or a pure-Python path with the same results.

A rank publishes "my data for step k is written" by storing k into its counter word; a peer
that reads a counter value >= k may then read that data. That needs a release store and an
acquire load. The C helper (``csrc/shm_sync.c``, built through ``ds_core.ops``) uses the
compiler's atomics, correct on every architecture. The Python path stores and loads aligned
8-byte words through a ``memoryview``: each is one machine access, and on x86-64 (total store
order: stores are not reordered with older stores, loads not with older loads) that already is
release/acquire. It is therefore offered only on x86-64; elsewhere, without a compiler, groups
use gloo. ``DS_CPU_SHM_SYNC=python`` forces the Python path (tests compare both).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

ENV_SYNC = "DS_CPU_SHM_SYNC"
SOURCE = Path(__file__).with_name("csrc") / "shm_sync.c"
_TSO_MACHINES = frozenset({"x86_64", "AMD64", "i686", "i386"})


class Flags(Protocol):
    """Release stores, acquire loads and a bounded wait on words of one segment."""

    kind: str

    def store(self, index: int, value: int) -> None: ...

    def load(self, index: int) -> int: ...

    def wait_all(self, indices: Sequence[int], target: int, slice_s: float) -> int:
        """Wait up to ``slice_s`` seconds for every word to reach ``target``.

        :returns: -1 when all have, else the position in ``indices`` of the first that has not.
        """
        ...


class PythonFlags:
    """Flags through a ``memoryview`` of 8-byte words (x86-64 only; see the module docstring)."""

    kind = "python"

    def __init__(self, words: memoryview) -> None:
        self._w = words

    def store(self, index: int, value: int) -> None:
        self._w[index] = value

    def load(self, index: int) -> int:
        value: int = self._w[index]
        return value

    def wait_all(self, indices: Sequence[int], target: int, slice_s: float) -> int:
        w, i, idle, deadline = self._w, 0, 0, 0.0
        while i < len(indices):
            if w[indices[i]] >= target:
                i += 1
                continue
            idle += 1
            if idle < 64:
                continue
            if idle == 64:
                deadline = time.monotonic() + slice_s
            elif time.monotonic() > deadline:
                return i
            # sleep(0) gives the GIL and the core away; then back off to 50 us naps.
            time.sleep(0 if idle < 512 else 5e-5)
        return -1


class CFlags:
    """Flags through the C helper (ctypes releases the GIL while it waits)."""

    kind = "c"

    def __init__(self, lib: Any, base: int, sleepers: int) -> None:
        self._lib, self._base, self._sleepers = lib, ctypes.c_void_p(base), sleepers
        self._prepared: dict[tuple[int, ...], Any] = {}

    def store(self, index: int, value: int) -> None:
        self._lib.ds_shm_store(self._base, index, value, self._sleepers)

    def load(self, index: int) -> int:
        value: int = self._lib.ds_shm_load(self._base, index)
        return value

    def wait_all(self, indices: Sequence[int], target: int, slice_s: float) -> int:
        key = tuple(indices)
        arr = self._prepared.get(key)
        if arr is None:
            arr = self._prepared[key] = (ctypes.c_int64 * len(key))(*key)
        result: int = self._lib.ds_shm_wait_all(
            self._base, arr, len(key), target, slice_s, self._sleepers
        )
        return result


# --------------------------------------------------------------------------- the C helper

_lock = threading.Lock()
_loaded: tuple[Any, str] | None = None


#: The helper's functions, checked against ``csrc/shm_sync.c`` when ds_core.ops builds it.
SIGNATURES = {
    "ds_shm_store": ("void", ("uint64_t *", "int64_t", "uint64_t", "int64_t")),
    "ds_shm_load": ("uint64_t", ("uint64_t *", "int64_t")),
    "ds_shm_wait_all": (
        "int64_t",
        ("uint64_t *", "const int64_t *", "int64_t", "uint64_t", "double", "int64_t"),
    ),
}
_NAME = "ds_cpu_shm_sync"
_CFLAGS = ["-std=c11"]
_native: Any = None  # ds_core.ops.NativeLib: builds once per process, keeps the failure


def _ops() -> Any:
    return importlib.import_module("ds_core.ops")  # the one home of compiled code


def build_helper() -> tuple[Any, str]:
    """Build (or reuse from the cache) and load the helper; ``(None, why)`` when impossible."""
    global _native
    try:
        ops = _ops()
    except ImportError:
        return None, "C helper unavailable: this ds_core has no ds_core.ops"
    if not hasattr(ops, "NativeLib"):
        return None, "C helper unavailable: this ds_core's ops predates NativeLib"
    if _native is None:
        _native = ops.NativeLib(
            _NAME, [SOURCE], SIGNATURES, env=ENV_SYNC, compiled="C helper",
            python="pure-Python flags", build_args=lambda: {"cflags": _CFLAGS},
        )  # fmt: skip
    try:
        lib = _native.library()
    except Exception as exc:  # no compiler, a failed build: the Python path stays correct
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"C helper unavailable ({first})"
    return lib, "C helper (csrc/shm_sync.c, built through ds_core.ops)"


def _compiler_note() -> str:
    try:
        ops = _ops()
    except ImportError:
        return "this ds_core has no ds_core.ops"
    cc = ops.compiler_path("c")
    return f"compiler {cc}" if cc else "no C compiler on PATH"


def c_helper() -> tuple[Any, str]:
    """The loaded C helper and a line saying where it came from, or ``(None, reason)``.

    Builds at most once per process (the build itself is cached per user across processes).
    """
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = build_helper()
        return _loaded


def python_allowed() -> tuple[bool, str]:
    machine = platform.machine()
    if machine in _TSO_MACHINES:
        return True, f"{machine} orders plain loads and stores as the protocol needs"
    return False, f"{machine} needs explicit barriers, which only the C helper provides"


def unavailable_reason() -> str:
    """Why this process has no synchronisation path ("" when it has one)."""
    why_c = ""
    if os.environ.get(ENV_SYNC, "").lower() != "python":
        lib, why_c = c_helper()
        if lib is not None:
            return ""
    ok, why = python_allowed()
    return "" if ok else f"{why}; {why_c}"


def choose_flags(words: memoryview, base: int, sleepers: int) -> Flags | None:
    """The flags implementation for a new segment, or ``None`` when neither path is usable.

    :param sleepers: distance in words from a counter to the word counting its sleepers.
    """
    if os.environ.get(ENV_SYNC, "").lower() != "python":
        lib, _why = c_helper()
        if lib is not None:
            return CFlags(lib, base, sleepers)
    ok, _why = python_allowed()
    return PythonFlags(words) if ok else None


def describe_path(build: bool) -> str:
    """Which synchronisation path new groups use, in words (for ``ds-core report``).

    :param build: build the C helper if needed to answer; ``False`` answers without running a
        compiler (the answer then says what would be tried).
    """
    forced = os.environ.get(ENV_SYNC, "").lower() == "python"
    ok, why = python_allowed()
    fallback = f"pure-Python flags ({why})" if ok else f"gloo ({why})"
    if forced:
        return f"pure-Python flags ({ENV_SYNC}=python)" if ok else fallback
    if build or _loaded is not None:
        lib, where = c_helper()
        return where if lib is not None else f"{fallback}; {where}"
    return f"C helper when ds_core.ops can build it ({_compiler_note()}), else {fallback}"


def compatibility() -> tuple[bool, str]:
    """Whether new shared-memory groups will synchronise through the C helper, and why.

    Runs no compiler and starts no thread (an op compatibility check must not). Whether shared
    memory is enabled at all is the transport's question (``ds_backend_cpu.shm_groups``), asked
    by the ``shm_sync`` op before this.
    """
    path = describe_path(build=False)
    return path.startswith("C helper"), f"shared-memory collectives synchronise through {path}"


def status() -> str:
    """Which path is active in this process, or would be, and whether the helper is built.

    Builds nothing (``ds-core report`` calls it, through the ``shm_sync`` op, which says
    "inactive" instead when shared memory is disabled).
    """
    if _loaded is not None:
        lib, where = _loaded
        return f"active: {where}" if lib is not None else f"active: {describe_path(False)}"
    if os.environ.get(ENV_SYNC, "").lower() == "python":
        return describe_path(build=False)
    try:
        built = _ops().cached_shared_library(_NAME, [SOURCE], cflags=_CFLAGS, signatures=SIGNATURES)
    except Exception as exc:
        return f"C helper cannot build ({str(exc).splitlines()[0]}); {describe_path(False)}"
    if built is None:
        return "C helper not built yet: builds at the first collective on a same-host group"
    return f"C helper built ({built.parent})"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, killed but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0:1]
    return bool(state) and state[0] not in ("Z", "X", "x")
