"""Run the DeepSpeed-style loops once per session and backend on 2 ranks of the run's rank
pools (tests/compat/_worker.py, tests/rankpool.py).

``loops`` is parametrised by :data:`COMPAT_BACKENDS`: every test that reads it runs on cpu and
on the simulated accelerator, against the same plain-PyTorch references. One sim mode, lazy:
queued device work runs only when waited for, so a loop that reads a result before its copy or
collective ran fails every time (the loops are small; the threads mode adds nothing they need).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.rankpool import RankPools
from tests.zero._common import backend_env
from tests.zero.conftest import installed_backends

WORLD = 2
#: cpu, and sim in lazy mode where installed (see the module docstring).
COMPAT_BACKENDS = [b for b in installed_backends() if b in ("cpu", "sim-lazy")]


@pytest.fixture(scope="session", params=COMPAT_BACKENDS)
def loops(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    rank_pools: RankPools,
) -> list[dict[str, Any]]:
    """Per rank: job name -> that loop's results, and ``"backend"``: the matrix entry."""
    backend = str(request.param)
    tmp = tmp_path_factory.mktemp(f"compat_loops-{backend}")
    pool = rank_pools.get(WORLD, backend_env(backend, WORLD))
    ranks: list[dict[str, Any]] = pool.run("tests.compat._worker:run_loops", str(tmp))
    for r in ranks:
        r["backend"] = backend
    return ranks
