"""The device mesh's groups and coordinates on 4 live ranks, against the layout written out
by hand in ds_core/comm/mesh.py (TP innermost, then SP, data, and pipeline outermost)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from ds_core import comm

SIZES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (1, 4, 1)]

# (tp, pp, sp) -> per rank: (tp group, dp group, pp group, sp group, pp_rank, dp_rank,
# tp_rank, sp_rank, data_rank); None = no group (or the world, for dp).
EXPECTED: dict[tuple[int, int, int], list[tuple[Any, ...]]] = {
    (1, 1, 1): [(None, None, None, None, 0, r, 0, 0, r) for r in range(4)],
    (2, 1, 1): [
        ([0, 1], [0, 2], None, None, 0, 0, 0, 0, 0),
        ([0, 1], [1, 3], None, None, 0, 0, 1, 0, 0),
        ([2, 3], [0, 2], None, None, 0, 1, 0, 0, 1),
        ([2, 3], [1, 3], None, None, 0, 1, 1, 0, 1),
    ],
    (1, 2, 1): [
        (None, [0, 1], [0, 2], None, 0, 0, 0, 0, 0),
        (None, [0, 1], [1, 3], None, 0, 1, 0, 0, 1),
        (None, [2, 3], [0, 2], None, 1, 0, 0, 0, 0),
        (None, [2, 3], [1, 3], None, 1, 1, 0, 0, 1),
    ],
    (1, 1, 2): [
        (None, None, None, [0, 1], 0, 0, 0, 0, 0),
        (None, None, None, [0, 1], 0, 1, 0, 1, 0),
        (None, None, None, [2, 3], 0, 2, 0, 0, 1),
        (None, None, None, [2, 3], 0, 3, 0, 1, 1),
    ],
    (2, 2, 1): [
        ([0, 1], [0], [0, 2], None, 0, 0, 0, 0, 0),
        ([0, 1], [1], [1, 3], None, 0, 0, 1, 0, 0),
        ([2, 3], [2], [0, 2], None, 1, 0, 0, 0, 0),
        ([2, 3], [3], [1, 3], None, 1, 0, 1, 0, 0),
    ],
    (1, 2, 2): [
        (None, [0, 1], [0, 2], [0, 1], 0, 0, 0, 0, 0),
        (None, [0, 1], [1, 3], [0, 1], 0, 1, 0, 1, 0),
        (None, [2, 3], [0, 2], [2, 3], 1, 0, 0, 0, 0),
        (None, [2, 3], [1, 3], [2, 3], 1, 1, 0, 1, 0),
    ],
    (1, 4, 1): [(None, [r], [0, 1, 2, 3], None, r, 0, 0, 0, 0) for r in range(4)],
}


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def mesh_job() -> dict[tuple[int, int, int], tuple[Any, ...]]:
    """Rank side: every mesh of ``SIZES``, as (groups, coordinates, stage ranks)."""
    out = {}
    for sizes in SIZES:
        m = comm.device_mesh(*sizes)
        out[sizes] = (
            _ranks(m.tp_group), _ranks(m.dp_group), _ranks(m.pp_group), _ranks(m.sp_group),
            m.pp_rank, m.dp_rank, m.tp_rank, m.sp_rank, m.data_rank,
            [m.stage_rank(s) for s in range(m.pp_size)],
        )  # fmt: skip
    comm.reset_device_mesh()
    return out


@pytest.mark.slow
def test_every_mesh_matches_the_documented_layout(rank_pools: Any) -> None:
    results = rank_pools.get(4, {"DS_ACCELERATOR": "cpu"}).run("tests.test_mesh:mesh_job")
    for sizes, expected in EXPECTED.items():
        for rank, want in enumerate(expected):
            got = results[rank][sizes]
            assert got[:9] == want, (sizes, rank, got, want)
            pp_group = want[2] or [rank]
            assert got[9] == pp_group, (sizes, rank, got[9])


def test_sizes_that_do_not_divide_the_world_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds_core.comm.mesh.get_world_size", lambda: 4)
    monkeypatch.setattr("ds_core.comm.mesh.get_rank", lambda: 0)
    with pytest.raises(ValueError, match=r"pipeline 3 × sequence 1 × tensor 1 .* world size 4"):
        comm.device_mesh(1, 3, 1)
    with pytest.raises(ValueError, match="sp_size must be a positive int, got 0"):
        comm.device_mesh(1, 1, 0)
