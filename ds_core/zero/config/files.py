"""Reading a config file: the one reader behind :func:`ds_core.zero.config.load_config`,
``initialize(config="ds.json")`` and ``examples/train_gpt.py --config``.

Every failure is one :class:`~ds_core.errors.ConfigError` naming the path: a missing path, a
directory, an unreadable or non-UTF-8 file, a file over :data:`MAX_CONFIG_BYTES`, an empty
file, invalid JSON (with line and column; hjson, which DeepSpeed also reads, is tried next),
nesting deeper than :data:`MAX_CONFIG_DEPTH`, a duplicate key (DeepSpeed refuses them too,
rather than keep the last), or a top level that is not an object.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ds_core.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "parse_config_text", "read_config_file"]

#: a config is a few kilobytes; a larger file is not one (a checkpoint, a data set).
MAX_CONFIG_BYTES = 4 * 2**20
#: objects and arrays nested deeper than this are refused before parsing (the parsers
#: recurse: a deeper file would end in a RecursionError).
MAX_CONFIG_DEPTH = 32


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _too_deep(text: str, limit: int) -> tuple[int, int] | None:
    """Line and column where nesting first exceeds ``limit`` (brackets outside strings)."""
    depth, line, col, in_string, escaped = 0, 1, 0, False, False
    for ch in text:
        col += 1
        if ch == "\n":
            line, col = line + 1, 0
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return line, col
        elif ch in "]}":
            depth -= 1
    return None


def parse_config_text(text: str, path: str) -> Any:
    """JSON, else hjson (DeepSpeed reads config files with hjson: comments, unquoted keys);
    duplicate keys refused in both."""
    where = _too_deep(text, MAX_CONFIG_DEPTH)
    if where is not None:
        raise ConfigError(
            f"config file {path!r} nests objects or arrays more than {MAX_CONFIG_DEPTH} "
            f"levels deep (at line {where[0]} column {where[1]}); a config is a shallow object"
        )
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKeyError as dup:
        raise _duplicate_error(path, dup.key) from None
    except json.JSONDecodeError as exc:
        error = (
            f"config file {path!r} is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}"
        )
    try:
        import hjson
    except ImportError:
        raise ConfigError(
            f"{error}; if it is an hjson file (as DeepSpeed accepts), install the optional "
            "dependency: pip install 'ds-core[hjson]'"
        ) from None
    try:
        return json.loads(json.dumps(hjson.loads(text, object_pairs_hook=_no_duplicates)))
    except _DuplicateKeyError as dup:
        raise _duplicate_error(path, dup.key) from None
    except Exception as exc:  # hjson raises its own HjsonDecodeError
        raise ConfigError(f"{error}; nor valid hjson: {exc}") from None


def _duplicate_error(path: str, key: str) -> ConfigError:
    return ConfigError(
        f"config file {path!r} gives the key {key!r} twice in one object; keep one (DeepSpeed "
        "refuses duplicate keys too, rather than silently keep the last)"
    )


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in the config file at ``path``, as a dict (not yet validated).

    :raises ConfigError: see the module's docstring.
    """
    name = os.fspath(path)
    if os.path.isdir(name):
        raise ConfigError(f"config file {name!r} is a directory; give the path of a JSON file")
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {name!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {name!r} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {name!r} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, the limit "
            "for a config; is it the right file?"
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {name!r} is not UTF-8 text: byte 0x{data[exc.start]:02x} at line "
            f"{line} (offset {exc.start}); save it as UTF-8"
        ) from None
    if not text.strip():
        raise ConfigError(f"config file {name!r} is empty; a config is a JSON object, e.g. {{}}")
    parsed = parse_config_text(text, name)
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"config file {name!r} must hold a JSON object, got {type(parsed).__name__}"
        )
    return parsed
