"""C bindings declared once, and the one "compiled or Python fallback" wrapper.

A compiled helper's functions are declared in one table, ``name -> (C return type, C argument
types)``, written as C (``"uint64_t"``, ``"const int64_t *"``). The same table

- is checked by the compiler when the library is built: the build compiles one translation
  unit that includes the sources and asserts, per function, that the definition's type is
  exactly the declared one (``__builtin_types_compatible_p``; an ``int`` declared where C has
  ``int64_t`` fails, as does a missing function, naming it);
- sets ``restype`` / ``argtypes`` of the loaded ``ctypes.CDLL``, after checking that every
  declared symbol is exported (a missing one is an :class:`OpBuildError` naming it).

Why ctypes and not cffi's API mode: docs/architecture.md §3.13 (measured with
``bench/native_bindings.py``).

:class:`NativeLib` is the shared wrapper of cpu_adam, the asynchronous I/O engine and the CPU
backend's shared-memory sync: choose ``auto`` / ``compiled`` / ``python`` from an environment
variable, build at most once per process, fall back to Python with one warning, and the status
line ``ds-core report`` shows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from ds_core.ops._build import build_shared_library, cached_shared_library
from ds_core.ops._cache import OpBuildError
from ds_core.ops._signatures import Signatures
from ds_core.ops._toolchain import compiler_path

__all__ = ["NativeLib"]


class _Described(Protocol):
    path: str

    def describe(self) -> str: ...


T = TypeVar("T", bound=_Described)


class NativeLib(Generic[T]):
    """One compiled helper with a pure-Python twin: which one runs, built once, reported.

    :param name: the op name in ``ds_core.ops``' cache.
    :param sources: its C sources; ``signatures`` its declared functions (see the module).
    :param env: the environment variable choosing ``auto`` (compiled if it builds, else Python
        with one warning), ``compiled`` (fail if it cannot build) or ``python``.
    :param compiled: the compiled path in words, for status lines ("compiled kernel").
    :param python: the Python path in words ("pure-PyTorch path").
    :param build_args: keyword arguments of :func:`~ds_core.ops.build_shared_library`
        (``cflags``, ``openmp``...), computed when needed.
    :param log: where the one fallback warning goes.

    ``loaded`` maps a choice to the object :meth:`load` made for it (tests may clear it).
    """

    CHOICES = ("auto", "compiled", "python")

    def __init__(
        self,
        name: str,
        sources: Sequence[str | os.PathLike[str]],
        signatures: Signatures,
        *,
        env: str,
        compiled: str,
        python: str,
        build_args: Callable[[], dict[str, Any]] = dict,
        log: logging.Logger | None = None,
    ) -> None:
        self.name, self.sources, self.signatures = name, [Path(s) for s in sources], signatures
        self.env, self.compiled, self.python = env, compiled, python
        self.build_args, self.log = build_args, log or logging.getLogger("ds_core.ops")
        self.loaded: dict[str, T] = {}
        self._lib: ctypes.CDLL | None = None
        self._failure: OpBuildError | None = None
        self._lock = threading.RLock()

    def requested(self, implementation: str | None = None) -> str:
        """The choice: ``implementation``, else the environment variable, else ``auto``.

        :raises ValueError: for an unknown name.
        """
        chosen = implementation or os.environ.get(self.env, "auto") or "auto"
        if chosen not in self.CHOICES:
            raise ValueError(f"{self.env}={chosen!r}: expected auto, compiled or python")
        return chosen

    def library(self) -> ctypes.CDLL:
        """Build (or take from the cache) and load the library, once per process.

        :raises OpBuildError: why it cannot be built or loaded (the same error on every call).
        """
        with self._lock:
            if self._lib is None:
                if self._failure is not None:
                    raise self._failure
                try:
                    self._lib = build_shared_library(
                        self.name, self.sources, signatures=self.signatures, quiet=True,
                        **self.build_args(),
                    )  # fmt: skip
                except OpBuildError as exc:
                    self._failure = exc
                    raise
            return self._lib

    @property
    def failure(self) -> str | None:
        """The first line of why the compiled path failed in this process, if it did."""
        return None if self._failure is None else str(self._failure).splitlines()[0]

    def load(
        self,
        implementation: str | None,
        compiled: Callable[[ctypes.CDLL], T],
        python: Callable[[], T],
    ) -> T:
        """The object for the chosen path, made once per choice.

        :raises OpBuildError: with ``compiled`` when the library cannot be built.
        """
        chosen = self.requested(implementation)
        with self._lock:
            if chosen in self.loaded:
                return self.loaded[chosen]
            made: T
            if chosen == "python":
                made = python()
            else:
                try:
                    made = compiled(self.library())
                except OpBuildError as exc:
                    if chosen == "compiled":
                        raise
                    # Same results either way, only slower: warn once and keep going.
                    self.log.warning("%s: using the %s: %s", self.name, self.python, exc)
                    made = python()
            self.loaded[chosen] = made
            return made

    def status(self) -> str:
        """Which path is (or would be) active, for ``ds-core report``. Builds nothing."""
        chosen = self.requested(None)
        if chosen in self.loaded:
            made = self.loaded[chosen]
            note = f" ({self.failure})" if made.path == "python" and self.failure else ""
            return f"active: {made.describe()}{note}"
        if chosen == "python":
            return f"{self.python} ({self.env}=python)"
        if compiler_path("c") is None:
            return f"{self.python}: no C compiler found (install gcc or clang, or set CC)"
        try:
            built = cached_shared_library(
                self.name, self.sources, signatures=self.signatures, **self.build_args()
            )
        except OpBuildError as exc:
            return f"{self.python}: {exc}"
        if built is None:
            return f"{self.compiled}, not built yet: builds on first use"
        return f"{self.compiled}, built ({built.parent})"
