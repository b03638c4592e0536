"""Value types of the config schema: JSON numbers as DeepSpeed writes them (5e8 is an int),
bools never count as numbers; every section model is frozen and forbids unknown keys."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Strict

__all__ = ["Bool", "Float", "Int", "FROZEN"]


def as_int(value: Any) -> Any:
    """An integer from an int or an integral float; ``ValueError`` naming what was given."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, not a bool ({value!r})")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"must be an integer, got {value!r}")
        return int(value)
    if not isinstance(value, int):
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}")
    return value


def as_float(value: Any) -> Any:
    """A finite float from an int or float; ``ValueError`` naming what was given."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not a bool ({value!r})")
    if not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"must be finite, got {value!r}")
    return float(value)


Int = Annotated[int, BeforeValidator(as_int)]
Float = Annotated[float, BeforeValidator(as_float)]
Bool = Annotated[bool, Strict()]

FROZEN = ConfigDict(frozen=True, extra="forbid")
