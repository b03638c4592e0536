"""The one home for compiled code: sources + flags -> a hash-keyed per-user cache -> loaded op.

Every compiled piece of ds_core (``cpu_adam``, the CPU backend's shared-memory sync helpers,
asynchronous file I/O) is built here, so there is one cache, one lock, one hash scheme and one
toolchain probe.

Two ways to build, one mechanism underneath:

- :func:`build_shared_library` compiles C/C++ into a plain shared library and returns a
  ``ctypes.CDLL``. The compiler runs as an argument list (no shell) and a build takes about a
  second. Use it for kernels over raw buffers (pass ``tensor.data_ptr()``): ``cpu_adam`` is
  built this way, so it does not depend on torch's C++ ABI or pybind11.
- :func:`build_extension` builds a torch C++ extension with the flags and ABI macros
  ``torch.utils.cpp_extension`` would use, in one compiler command (no shell, no ninja), for
  code that must take ``at::Tensor`` arguments.

Both share the cache: ``$DS_CORE_OPS_CACHE``, else ``$XDG_CACHE_HOME/ds_core/ops``, else
``~/.cache/ds_core/ops``, created with mode 0700 and refused when owned by another user. A build
is keyed by the SHA-256 of its sources' bytes, its flags, the compiler's path and version, and
the torch, Python and platform versions. A folder whose manifest does not match the key, or
whose artefact's SHA-256 does not match the manifest, is rebuilt, never loaded. Ranks building
at once take an ``flock``: one builds, the others wait and then load. The first build prints
progress on stderr; a failed build raises :class:`OpBuildError` with the command and the
compiler's last lines. ``KeyboardInterrupt`` and ``SystemExit`` always propagate (the
compiler child is killed, temporary files are removed).

:func:`toolchain` says which compilers are present; :func:`compiler_path` answers without
starting a process, for side-effect-free ``is_compatible`` checks.

A library's functions are declared once, ``signatures={name: (C return type, C argument
types)}``: the build checks each against its C definition (a missing function or another type
fails the build, naming it) and the loaded library has every ``restype`` / ``argtypes`` set.
:class:`NativeLib` is the one "compiled, else the Python path" wrapper (choice from an
environment variable, one build per process, one fallback warning, the ``ds-core report``
status line) that cpu_adam, the I/O engine and the CPU backend's shm sync share. Why ctypes
and not cffi: docs/architecture.md §3.13.

Example::

    lib = ds_core.ops.build_shared_library(
        "my_sync", ["sync.c"], cflags=["-std=c11"],
        signatures={"my_fn": ("int", ("void *", "int64_t"))},
    )
    lib.my_fn(tensor.data_ptr(), 4)
"""

from __future__ import annotations

from ds_core.ops._build import build_extension, build_shared_library, cached_shared_library
from ds_core.ops._cache import ENV_CACHE, OpBuildError, cache_root
from ds_core.ops._native import NativeLib
from ds_core.ops._signatures import Signatures
from ds_core.ops._toolchain import Toolchain, compiler_path, toolchain

__all__ = [
    "ENV_CACHE",
    "NativeLib",
    "OpBuildError",
    "Signatures",
    "Toolchain",
    "build_extension",
    "build_shared_library",
    "cached_shared_library",
    "cache_root",
    "compiler_path",
    "toolchain",
]
