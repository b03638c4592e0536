"""The compat tests' rank job: every DeepSpeed-style loop of tests/compat/_loops.py at stages
0-3, on each rank of a rank pool (tests/rankpool.py). Results come back on the host."""

from __future__ import annotations

from typing import Any

from ds_core.errors import ConfigError
from tests.compat import _api, _loops
from tests.zero._common import to_host


def run_loops(outdir: str) -> dict[str, Any]:
    """Every loop on this rank (a :class:`tests.rankpool.RankPool` rank); its results."""
    from ds_core import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {"nosync_s0": _loops.nosync_loop(world, rank), "errors": _api.errors()}
    for stage in range(4):
        out[f"members_s{stage}"] = _api.members(stage)
        try:  # refused where the device has no autocast (tests/compat/test_loops.py)
            out[f"autocast_s{stage}"] = _loops.autocast_loop(stage, world, rank)
        except ConfigError as exc:
            out[f"autocast_s{stage}"] = {"refused": str(exc)}
        out[f"simple_s{stage}"] = _loops.simple_loop(stage, world, rank)
        out[f"simple_load_s{stage}"] = _loops.simple_loop(stage, world, rank, load=True)
        out[f"cifar_s{stage}"] = _loops.cifar_loop(stage, world, rank, outdir)
        out[f"gan_s{stage}"] = _loops.gan_loop(stage, world, rank)
    return to_host(out)
