"""The pipeline tests run on the CPU backend and on sim (threads) where it is installed, as
the engine's suites do (tests/zero/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

_SIM = importlib.util.find_spec("ds_backend_sim") is not None and bool(
    shutil.which(os.environ.get("CXX", "c++"))
)
BACKENDS = ["cpu", *(["sim-threads"] if _SIM else [])]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each installed backend the pipeline runs on."""
    return str(request.param)
