"""Checks a backend runs on its configuration: options, the process-group library, dtypes."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ds_core.errors import ConfigError

_BASE_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float32, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}
)


def dtype_set(*, fp16: bool, bf16: bool, fp64: bool, fp8: bool) -> frozenset[torch.dtype]:
    """float32 and the integer types, plus each optional family the vendor reported.

    ``fp8`` adds ``float8_e4m3fn`` and ``float8_e5m2`` where this torch defines them.
    """
    dtypes = set(_BASE_DTYPES)
    if fp16:
        dtypes.add(torch.float16)
    if bf16:
        dtypes.add(torch.bfloat16)
    if fp64:
        dtypes.add(torch.float64)
    if fp8:
        dtypes.update(
            getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)
        )
    return frozenset(dtypes)


def require_dist_backend(name: str, hint: str) -> bool:
    """Check that ``torch.distributed`` can create process groups named ``name``.

    Uses ``torch.distributed.is_<name>_available()`` where torch has one, else the registered
    backend list (which vendor imports extend).

    :param hint: what the user should do when it is missing.
    :returns: ``True``.
    :raises RuntimeError: naming the backend and ``hint`` when it is unusable.
    """
    if not dist.is_available():
        raise RuntimeError(f"this torch build has no torch.distributed; {hint}")
    checker = getattr(dist, f"is_{name}_available", None)
    ok = bool(checker()) if checker is not None else name in dist.Backend.backend_list
    if not ok:
        raise RuntimeError(
            f"torch.distributed backend '{name}' is not available in torch "
            f"{torch.__version__}; {hint}"
        )
    return True


def require_device_index(index: object) -> int:
    """``index`` when it is a device index by type: an ``int`` that is not a ``bool``.

    :raises TypeError: naming the type, for anything else (``1.0``, ``"1"``, ``True``,
        ``None``); a float would otherwise become the current "device" and a bool a real one.
    """
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(
            f"a device index is an int, got {type(index).__name__} {index!r}; pass int(index)"
        )
    return index


def require_int(name: str, value: object) -> int:
    """``value`` when it is an ``int`` that is not a ``bool``.

    :raises TypeError: naming ``name`` and the type, for anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is an int, got {type(value).__name__} {value!r}; pass int({name})")
    return value


#: Seeds a generator takes: 64 unsigned bits (ds_core/hookspecs: the range rules).
SEED_RANGE: range = range(2**64)


def check_seed(seed: object) -> int:
    """``seed`` when it is an ``int`` in :data:`SEED_RANGE`.

    :raises TypeError: for anything but an ``int`` (a ``bool`` or ``float`` is not one).
    :raises ValueError: for a negative seed or one of 2**64 or more, naming the range.
    """
    value = require_int("seed", seed)
    if value not in SEED_RANGE:
        raise ValueError(
            f"seed {value} is out of range: a seed is an int in range(2**64); reduce it, e.g. "
            f"seed % 2**64"
        )
    return value


def check_device_index(index: object, count: int, who: str) -> int | None:
    """``index`` when it is ``None`` (the current device) or an ``int`` in ``range(count)``:
    the rule every hook with an ``index: int | None`` argument follows (ds_core/hookspecs).

    :param count: the devices this process sees (``ds_device_count()``).
    :param who: what sees them, for the message (a torch module name, or ``"the cpu backend"``).
    :raises TypeError: naming the type, for anything but ``None`` and an ``int`` (a ``bool``
        or a ``float`` is not one).
    :raises ValueError: naming ``count``, for an ``int`` outside ``range(count)``.
    """
    if index is None:
        return None
    i = require_device_index(index)
    if not 0 <= i < count:
        raise ValueError(
            f"device index {i} is out of range: {who} sees {count} device(s); pass an index "
            f"in range({count}), or None for the current device"
        )
    return i


def check_options(backend: str, options: Mapping[str, Any], known: Collection[str]) -> bool:
    """Validate a backend's configure options: only names in ``known`` are accepted.

    :returns: ``True``.
    :raises ds_core.ConfigError: naming each unknown key and the accepted ones.
    """
    unknown = sorted(set(options) - set(known))
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise ConfigError(
            f"accelerator.{backend} has unknown option(s) {', '.join(unknown)}; accepted: "
            f"{accepted}"
        )
    return True
