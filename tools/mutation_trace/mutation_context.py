"""pytest plugin of the mutation tool's coverage run (``-p mutation_context``).

Sets the tracing context (:mod:`sitecustomize` next to this file): the check's id while its
function-scoped set-up and its call run; the empty context ("every check") while a shared
(class, module or session) fixture is set up and while checks tear down, since what those run
serves or follows more than one check. Writes ``items.json`` to ``DS_MUT_TRACE_DIR``: each
collected check's id -> the argument that selects it alone, and the collective case it reads
(its rank worker records that case's lines under ``case:<key>``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import sitecustomize  # the tracer (tools/mutation_trace/sitecustomize.py)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = params.get("case")
        out[item.nodeid] = {
            "arg": f"{item.path}::{rest}",
            "case": getattr(case, "key", None),
        }
    Path(os.environ["DS_MUT_TRACE_DIR"], "items.json").write_text(json.dumps(out))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    sitecustomize.set_context(item.nodeid)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Generator[None, None, None]:
    before = sitecustomize.context
    if fixturedef.scope != "function":
        sitecustomize.set_context("")
    yield
    sitecustomize.set_context(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    sitecustomize.set_context(item.nodeid)
    yield
    sitecustomize.set_context("")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    sitecustomize.set_context("")
    yield
