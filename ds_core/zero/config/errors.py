"""Config error messages: a dotted path, what is wrong, and the closest known key."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from pydantic import BaseModel, ValidationError

from ds_core.errors import ConfigError
from ds_core.zero.config.deepspeed_keys import dotted, extra_keys

__all__ = ["ConfigProblemsError", "fail", "messages", "unknown_key_message"]

ModelFor = Callable[[tuple[str | int, ...]], type[BaseModel] | None]


def _known_keys(section: tuple[str | int, ...], model: type[BaseModel] | None) -> list[str]:
    keys = list(model.model_fields) if model is not None else []
    keys += sorted(extra_keys(tuple(p for p in section if isinstance(p, str))))
    return keys


def unknown_key_message(path: tuple[str | int, ...], model: type[BaseModel] | None) -> str:
    key = str(path[-1])
    known = _known_keys(path[:-1], model)
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{dotted((*path[:-1], match[0]))}'?" if match else ""
    where = f"in '{dotted(path[:-1])}'" if path[:-1] else "at the top level"
    return f"{dotted(path)}: unknown key {where}{hint}"


_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def messages(exc: ValidationError, prefix: tuple[str | int, ...], model_for: ModelFor) -> list[str]:
    """One line per validation error of a section at ``prefix``; ``model_for(loc)`` is the
    model of the section at ``loc`` (for the keys an unknown key is matched against)."""
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        path = (*prefix, *loc)
        if err["type"] == "extra_forbidden":
            lines.append(unknown_key_message(path, model_for(loc[:-1])))
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required"
        elif err["type"] == "model_type" or err["type"] == "dict_type":
            msg = f"must be an object, got {type(err['input']).__name__} {err['input']!r}"
        elif err["type"] in _BOUNDS:
            bound = next(iter(err.get("ctx", {}).values()), "?")
            if isinstance(bound, float) and bound.is_integer():
                bound = int(bound)
            msg = f"must be {_BOUNDS[err['type']]} {bound}, got {err['input']!r}"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg[0].lower()}{msg[1:]} (got {err['input']!r})"
        lines.append(f"{dotted(path)}: {msg}" if path else msg)
    return lines


class ConfigProblemsError(ConfigError):
    """A :class:`ConfigError` that keeps its problems apart, so a caller gathering problems
    from several checks can list each once under one header."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            super().__init__(f"invalid ds_core config: {problems[0]}")
        else:
            items = "\n".join(f"  - {line}" for line in problems)
            super().__init__(f"invalid ds_core config:\n{items}")


def fail(lines: list[str]) -> ConfigError:
    """One :class:`ConfigError` listing every problem, each once, under one header."""
    return ConfigProblemsError(list(dict.fromkeys(lines)))
