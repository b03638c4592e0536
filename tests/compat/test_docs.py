"""docs/from-deepspeed.md cannot drift from the code: every API it lists exists, and its
refused / ignored key lists equal the config's tables."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from ds_core.zero.config import deepspeed_keys
from ds_core.zero.engine import ZeroEngine

DOC = (Path(__file__).resolve().parents[2] / "docs" / "from-deepspeed.md").read_text()


def section(title: str) -> str:
    start = DOC.index(f"## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end != -1 else None]


def resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


API = re.findall(
    r"^\| `deepspeed\.[\w.]+` \| `(ds_core\.[\w.]+)` \|", section("Supported API"), re.M
)
MEMBERS = re.findall(r"^\| `engine\.(\w+)` \|", section("Engine members"), re.M)


def test_tables_are_not_empty() -> None:
    assert len(API) >= 15 and len(MEMBERS) >= 30


@pytest.mark.parametrize("dotted", API)
def test_every_listed_api_exists(dotted: str) -> None:
    assert callable(resolve(dotted)), dotted


@pytest.mark.parametrize("name", MEMBERS)
def test_every_listed_engine_member_exists(name: str) -> None:
    source = inspect.getsource(ZeroEngine.__init__)
    assert hasattr(ZeroEngine, name) or re.search(rf"self\.{name}\b[^(]*=", source), name


def listed(marker: str) -> list[str]:
    block = DOC.split(f"<!-- {marker} -->")[1].split(f"<!-- /{marker} -->")[0]
    return re.findall(r"^- `([\w.]+)`$", block, re.M)


def code_keys(table: dict[tuple[str, ...], frozenset[str]]) -> set[str]:
    return {".".join((*path, key)) for path, keys in table.items() for key in keys}


def test_refused_keys_match_the_config_table() -> None:
    assert set(listed("refused-keys")) == code_keys(deepspeed_keys._UNSUPPORTED)


def test_ignored_keys_match_the_config_table() -> None:
    assert set(listed("ignored-keys")) == code_keys(deepspeed_keys._IGNORED)
