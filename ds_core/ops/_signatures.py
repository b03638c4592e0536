"""C signatures declared once: the table type, its ctypes types, the compiler checks a build
appends, and binding a loaded library (see :mod:`ds_core.ops._native` for how they are used)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from ds_core.ops._cache import OpBuildError

__all__ = ["Signatures", "bind", "ctype", "render_checks"]

#: ``function name -> (C return type, C argument types)``.
Signatures = Mapping[str, tuple[str, Sequence[str]]]

_SCALARS: dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "unsigned": ctypes.c_uint,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


def _norm(c_type: str) -> str:
    return " ".join(c_type.replace("*", " * ").split())


def ctype(c_type: str) -> Any:
    """The ctypes type that carries ``c_type`` (a scalar, ``char *`` as bytes, any other
    pointer as ``c_void_p``: an address, a ctypes array or ``byref``).

    :raises OpBuildError: for a type this table does not know.
    """
    t = _norm(c_type)
    if t.endswith("*"):
        base = t[:-1].replace("const", "").strip()
        return ctypes.c_char_p if base == "char" else ctypes.c_void_p
    if t not in _SCALARS:
        raise OpBuildError(
            f"C type {c_type!r} has no ctypes mapping here (known: {sorted(_SCALARS)})"
        )
    return _SCALARS[t]


def _prototype(name: str, restype: str, argtypes: Sequence[str]) -> str:
    return f"{_norm(restype)} {name}({', '.join(map(_norm, argtypes)) or 'void'})"


def render_checks(signatures: Signatures, cxx: bool = False) -> str:
    """C (or C++) assertions that each declared function has exactly its declared type."""
    lines = ["#include <type_traits>"] if cxx else []
    for name, (restype, argtypes) in sorted(signatures.items()):
        for t in (restype, *argtypes):
            ctype(t)  # an unknown type fails here, before the compiler runs
        pointer = f"{_norm(restype)} (*)({', '.join(map(_norm, argtypes)) or 'void'})"
        message = f'"ds_core.ops: {name} is declared in Python as {_prototype(name, restype, argtypes)}, unlike its C definition"'
        if cxx:
            lines.append(
                f"static_assert(std::is_same<decltype(&{name}), {pointer}>::value, {message});"
            )
        else:
            lines.append(
                f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), {pointer}), {message});"
            )
    return "\n".join(lines) + "\n"


def bind(lib: ctypes.CDLL, signatures: Signatures, what: str) -> ctypes.CDLL:
    """Set every declared function's ``restype`` / ``argtypes`` on ``lib``.

    :raises OpBuildError: naming each declared symbol ``lib`` does not export.
    """
    missing = []
    for name in signatures:
        try:
            getattr(lib, name)
        except AttributeError:
            missing.append(name)
    if missing:
        raise OpBuildError(
            f"{what}: {lib._name} does not export the declared symbol(s) {', '.join(missing)}"
        )
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = ctype(restype)
        fn.argtypes = [ctype(t) for t in argtypes]
    return lib
