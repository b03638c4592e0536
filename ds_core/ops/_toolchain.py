"""Toolchain probe: which C/C++ compiler is here, its version, and whether it links OpenMP.

Two levels, because op compatibility checks must not run a compiler (issue 12):

- :func:`compiler_path` only searches ``PATH`` (no process is started);
- :func:`toolchain` runs ``<cc> --version`` and one OpenMP compile-and-link probe, once per
  process; builds and ``ds-core report`` use it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Toolchain", "compiler_path", "toolchain"]

# Environment variables that choose the compilers, as make and setuptools read them.
ENV_CC = "CC"
ENV_CXX = "CXX"
_CC_NAMES = ("cc", "gcc", "clang")
_CXX_NAMES = ("c++", "g++", "clang++")
_PROBE_SECONDS = 60.0


def _find(env: str, names: tuple[str, ...]) -> str | None:
    chosen = os.environ.get(env)
    if chosen:
        # A value such as "ccache gcc" is not supported: commands run without a shell, so the
        # variable must name one executable.
        return shutil.which(chosen)
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def compiler_path(language: str = "c") -> str | None:
    """Return the path of the C (``language="c"``) or C++ (``"c++"``) compiler, or ``None``.

    Reads ``CC`` / ``CXX`` first, then looks for ``cc, gcc, clang`` (``c++, g++, clang++``) on
    ``PATH``. Starts no process, so op compatibility checks may call it.

    :raises ValueError: for a language other than ``"c"`` or ``"c++"``.
    """
    if language == "c":
        return _find(ENV_CC, _CC_NAMES)
    if language == "c++":
        return _find(ENV_CXX, _CXX_NAMES)
    raise ValueError(f"language={language!r}: expected 'c' or 'c++'")


@dataclass(frozen=True, slots=True)
class Toolchain:
    """What :func:`toolchain` found.

    :param cc: path of the C compiler, or ``None``.
    :param cc_version: first line of ``cc --version`` ("" when there is no compiler).
    :param cxx: path of the C++ compiler, or ``None``.
    :param cxx_version: first line of ``c++ --version``.
    :param openmp: whether ``cc -fopenmp`` compiles and links a parallel loop.
    """

    cc: str | None
    cc_version: str
    cxx: str | None
    cxx_version: str
    openmp: bool

    @property
    def has_c(self) -> bool:
        """True when a C compiler was found."""
        return self.cc is not None

    def describe(self) -> str:
        """One line for reports and error messages."""
        if self.cc is None:
            return f"no C compiler found (set {ENV_CC} or install gcc/clang)"
        omp = "OpenMP" if self.openmp else "no OpenMP"
        return f"{self.cc} ({self.cc_version}; {omp})"


def _version(compiler: str | None) -> str:
    if compiler is None:
        return ""
    try:
        done = subprocess.run(
            [compiler, "--version"],
            capture_output=True,
            text=True,
            timeout=_PROBE_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unusable: {exc}"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else f"exit code {done.returncode}"


_OPENMP_PROBE = """
#include <omp.h>
int ds_probe(int n) {
    int s = 0;
    #pragma omp parallel for reduction(+:s)
    for (int i = 0; i < n; ++i) s += i;
    return s + omp_get_max_threads();
}
"""


def _openmp_links(compiler: str | None) -> bool:
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory(prefix="ds_core_omp_probe_") as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(_OPENMP_PROBE)
        cmd = [compiler, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(Path(tmp) / "p.so")]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=_PROBE_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    """Probe the compilers once per process (runs ``--version`` and one OpenMP test build).

    Never raises for a missing or broken compiler: the answer says what is absent. Does not
    touch a device. ``toolchain.cache_clear()`` forgets the answer (tests change ``CC``).
    """
    cc = compiler_path("c")
    cxx = compiler_path("c++")
    return Toolchain(
        cc=cc,
        cc_version=_version(cc),
        cxx=cxx,
        cxx_version=_version(cxx),
        openmp=_openmp_links(cc),
    )
