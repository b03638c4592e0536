"""Build-or-load for the two kinds of compiled op: a plain C/C++ shared library (ctypes) and a
torch C++ extension module. Both go through the same key, cache folder, lock and manifest.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ds_core.ops._cache import (
    BuildKey,
    Manifest,
    OpBuildError,
    cache_root,
    file_lock,
    make_key,
)
from ds_core.ops._signatures import Signatures, bind, render_checks
from ds_core.ops._toolchain import toolchain

__all__ = ["build_extension", "build_shared_library", "cached_shared_library"]

_CXX_SUFFIXES = {".cc", ".cpp", ".cxx", ".C"}
_OUTPUT_TAIL_LINES = 40
# In-process cache: one load per key, so a second caller gets the same object.
_LOADED: dict[str, Any] = {}
_LOADED_LOCK = threading.Lock()


def _tail(text: str, lines: int = _OUTPUT_TAIL_LINES) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n".join("    " + line for line in kept) or "    (no output)"


def _sources(name: str, sources: Sequence[str | os.PathLike[str]]) -> list[Path]:
    if not sources:
        raise OpBuildError(f"op '{name}': no sources given")
    paths = [Path(s).resolve() for s in sources]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise OpBuildError(f"op '{name}': source file(s) not found: {', '.join(missing)}")
    return paths


def _note(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"ds_core.ops: {msg}", file=sys.stderr, flush=True)


def _build_or_load(
    key: BuildKey,
    build: Any,  # Callable[[Path], Path]: builds into the folder, returns the artefact
    load: Any,  # Callable[[Path], T]
    quiet: bool,
) -> Any:
    with _LOADED_LOCK:
        if key.digest in _LOADED:
            return _LOADED[key.digest]
        root = cache_root()
        folder = root / key.folder_name
        manifest = Manifest(folder)
        artefact = manifest.valid_artefact(key)
        if artefact is None:
            with file_lock(root / f"{key.folder_name}.lock", f"op '{key.name}'"):
                # Another rank may have finished the build while we waited for the lock.
                artefact = manifest.valid_artefact(key)
                if artefact is None:
                    folder.mkdir(mode=0o700, exist_ok=True)
                    with contextlib.suppress(FileNotFoundError):
                        (folder / "manifest.json").unlink()  # no stale claim during the build
                    _note(f"building op '{key.name}' (first use; cache {folder})", quiet)
                    started = time.monotonic()
                    artefact = build(folder)
                    seconds = time.monotonic() - started
                    manifest.write(key, artefact, seconds)
                    _note(f"built op '{key.name}' in {seconds:.1f} s", quiet)
        loaded = load(artefact)
        _LOADED[key.digest] = loaded
        return loaded


def _run(cmd: list[str], name: str, cwd: Path) -> None:
    """Run one compiler command without a shell; an interrupt kills it and propagates."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise OpBuildError(
            f"op '{name}': could not start the compiler: {exc}\n  command: {shlex.join(cmd)}"
        ) from exc
    if done.returncode != 0:
        raise OpBuildError(
            f"op '{name}' failed to build (exit code {done.returncode})\n"
            f"  command: {shlex.join(cmd)}\n"
            f"  compiler output (last {_OUTPUT_TAIL_LINES} lines):\n"
            f"{_tail(done.stdout + done.stderr)}"
        )


def _compile_into(
    folder: Path, artefact_name: str, name: str, command: Callable[[str], list[str]]
) -> Path:
    """Run ``command(output_path)`` into a temporary file of ``folder``, then rename it to
    ``artefact_name`` (atomic: a reader sees the old file or the whole new one)."""
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{artefact_name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _run(command(str(tmp)), name, folder)
        final = folder / artefact_name
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return final


def _shared_library_plan(
    name: str,
    sources: Sequence[str | os.PathLike[str]],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    include_dirs: Sequence[str | os.PathLike[str]],
    depends: Sequence[str | os.PathLike[str]],
    openmp: bool,
    signatures: Signatures | None = None,
) -> tuple[BuildKey, str, list[str], list[Path], str]:
    paths = _sources(name, sources)
    cxx = any(p.suffix in _CXX_SUFFIXES for p in paths)
    tc = toolchain()
    compiler, version = (tc.cxx, tc.cxx_version) if cxx else (tc.cc, tc.cc_version)
    if compiler is None:
        raise OpBuildError(
            f"op '{name}' needs a {'C++' if cxx else 'C'} compiler and none was found; "
            f"install gcc or clang, or set {'CXX' if cxx else 'CC'}"
        )
    if openmp and not tc.openmp:
        raise OpBuildError(f"op '{name}' asks for OpenMP, which {compiler} cannot link")
    flags = ["-O3", "-fPIC", "-shared", *(["-fopenmp"] if openmp else []), *cflags]
    flags += [f"-I{Path(d).resolve()}" for d in include_dirs]
    checks = render_checks(signatures, cxx) if signatures else ""
    key = make_key(
        name,
        "shared_library",
        [*paths, *(Path(d).resolve() for d in depends)],
        [*flags, "--ld", *ldflags, *(["--signatures", checks] if checks else [])],
        compiler,
        version,
    )
    return key, compiler, flags, paths, checks


def cached_shared_library(
    name: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    depends: Sequence[str | os.PathLike[str]] = (),
    openmp: bool = False,
    signatures: Signatures | None = None,
) -> Path | None:
    """Return the verified cached artefact :func:`build_shared_library` would load, or ``None``.

    Builds nothing and loads nothing (it runs the toolchain probe), for reports.

    :raises OpBuildError: as :func:`build_shared_library` does before building.
    """
    key, *_ = _shared_library_plan(
        name, sources, cflags, ldflags, include_dirs, depends, openmp, signatures
    )
    return Manifest(cache_root() / key.folder_name).valid_artefact(key)


def build_shared_library(
    name: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    depends: Sequence[str | os.PathLike[str]] = (),
    openmp: bool = False,
    signatures: Signatures | None = None,
    quiet: bool = False,
) -> ctypes.CDLL:
    """Compile ``sources`` into a shared library (or take it from the cache) and load it.

    The compiler is ``CC`` (``CXX`` when any source is C++), run as a list of arguments, never
    through a shell. Default flags are ``-O3 -fPIC -shared``; ``cflags`` follow them, so they
    can override. Nothing ties the library to torch, but torch's version is part of the key
    like everything else that may change the artefact.

    :param name: op name; a C identifier-like string used in file names.
    :param sources: C or C++ files.
    :param cflags: extra compile flags (e.g. ``["-std=c11", "-DN=4"]``).
    :param ldflags: extra link flags (e.g. ``["-lrt"]``), placed after the sources.
    :param include_dirs: folders for ``-I``.
    :param depends: headers or other files whose contents must be part of the key.
    :param openmp: compile and link with ``-fopenmp``.
    :param signatures: the library's functions, ``name -> (C return type, C argument types)``
        (:mod:`ds_core.ops._signatures`): the compiler checks each definition has exactly that
        type (the sources are compiled as one translation unit that includes them and asserts
        it), and the loaded library gets each function's ``restype`` / ``argtypes``.
    :param quiet: do not print build progress on stderr.
    :returns: the loaded library (one ``ctypes.CDLL`` per key per process).
    :raises OpBuildError: no compiler, no OpenMP when asked, unreadable sources, a failed
        compile (with the command and the compiler's last lines; a declared function missing
        or unlike its definition is named there), a declared symbol the library does not
        export (named), or a failed load.
    """
    key, compiler, flags, paths, checks = _shared_library_plan(
        name, sources, cflags, ldflags, include_dirs, depends, openmp, signatures
    )
    artefact_name = f"lib{name}.so"

    def build(folder: Path) -> Path:
        inputs = list(map(str, paths))
        if checks:
            # One unit: the sources (absolute includes keep their names in diagnostics and
            # their own relative includes), then the assertions on their definitions.
            suffix = ".cc" if any(p.suffix in _CXX_SUFFIXES for p in paths) else ".c"
            unit = folder / f"{name}_checked{suffix}"
            unit.write_text("".join(f'#include "{p}"\n' for p in paths) + checks)
            inputs = [str(unit)]
        return _compile_into(
            folder,
            artefact_name,
            name,
            lambda out: [compiler, *flags, *inputs, "-o", out, *ldflags],
        )

    def load(artefact: Path) -> ctypes.CDLL:
        try:
            lib = ctypes.CDLL(str(artefact))
        except OSError as exc:
            raise OpBuildError(f"op '{name}': built {artefact} but cannot load it: {exc}") from exc
        return bind(lib, signatures, f"op '{name}'") if signatures else lib

    lib: ctypes.CDLL = _build_or_load(key, build, load, quiet)
    return lib


def _torch_extension_flags(module_name: str) -> list[str]:
    """Compile flags of a torch extension: the ones ``torch.utils.cpp_extension`` uses."""
    import torch
    from torch.utils import cpp_extension

    flags = ["-O3", "-fPIC", "-shared", "-std=c++17"]
    flags += [f"-I{d}" for d in cpp_extension.include_paths()]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    flags += [
        f"-DTORCH_EXTENSION_NAME={module_name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    # pybind11 refuses to share types with a module built under other ABI tags.
    for tag in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{tag}", None)
        if value is not None:
            flags.append(f'-DPYBIND11_{tag}="{value}"')  # an argv entry: the quotes are kept
    return flags


def _torch_extension_ldflags() -> list[str]:
    """Link flags of a torch extension (libtorch is already loaded when it is imported)."""
    from torch.utils import cpp_extension

    out = [f"-L{d}" for d in cpp_extension.library_paths()]
    return [*out, "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def build_extension(
    name: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    depends: Sequence[str | os.PathLike[str]] = (),
    quiet: bool = False,
) -> ModuleType:
    """Build a torch C++ extension (``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``) and import it.

    One compile-and-link command, run as a list of arguments (no shell, no ninja), with the
    include paths, library paths and ABI macros ``torch.utils.cpp_extension`` would pass
    (``_GLIBCXX_USE_CXX11_ABI`` and pybind11's ABI tags read from the running torch), into the
    cache folder of its key. Later runs import the cached module directly after checking its
    hash. Prefer :func:`build_shared_library` for code that only needs raw buffers: it builds
    in about a second, where torch's headers make an extension take a minute or more.

    :param name: op name; the Python module is named ``<name>_<key prefix>``.
    :param sources: C++ files.
    :param cflags: extra compile flags; ``ldflags`` extra link flags; ``include_dirs`` for -I.
    :param depends: files whose contents must be part of the key (headers).
    :param quiet: do not print build progress.
    :returns: the imported extension module.
    :raises OpBuildError: no C++ compiler, or a failed build (with the command and the
        compiler's last lines) or import.
    """
    paths = _sources(name, sources)
    tc = toolchain()
    if tc.cxx is None:
        raise OpBuildError(f"op '{name}' needs a C++ compiler; install g++ or clang, or set CXX")
    flags = [*cflags, *(f"-I{Path(d).resolve()}" for d in include_dirs)]
    key = make_key(
        name,
        "torch_extension",
        [*paths, *(Path(d).resolve() for d in depends)],
        [*flags, "--ld", *ldflags],
        tc.cxx,
        tc.cxx_version,
    )
    module_name = f"{name}_{key.digest[:12]}"
    artefact_name = f"{module_name}.so"
    built: dict[str, ModuleType] = {}

    def build(folder: Path) -> Path:
        return _compile_into(
            folder,
            artefact_name,
            name,
            lambda out: [
                tc.cxx or "c++",
                *_torch_extension_flags(module_name),
                *flags,
                *map(str, paths),
                "-o",
                out,
                *_torch_extension_ldflags(),
                *ldflags,
            ],
        )

    def load(artefact: Path) -> ModuleType:
        # Importing the same single-phase extension twice re-runs its init; reuse torch's.
        if module_name in built:
            return built[module_name]
        if module_name in sys.modules:
            return sys.modules[module_name]
        import torch  # noqa: F401  (the module links against libtorch, loaded by this import)

        loader = importlib.machinery.ExtensionFileLoader(module_name, str(artefact))
        spec = importlib.util.spec_from_file_location(module_name, artefact, loader=loader)
        if spec is None:
            raise OpBuildError(f"op '{name}': cannot import {artefact}")
        module = importlib.util.module_from_spec(spec)
        try:
            loader.exec_module(module)
        except ImportError as exc:
            raise OpBuildError(f"op '{name}': cannot import {artefact}: {exc}") from exc
        sys.modules[module_name] = module
        return module

    module: ModuleType = _build_or_load(key, build, load, quiet)
    return module
