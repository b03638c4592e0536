"""ZeRO smoke: the engine trains on this backend at every stage and matches plain torch.

A tiny model is trained a few steps on 2 ranks with ``ds_core.initialize`` at stages 0-3,
with the backend's own collectives, and compared with single-process torch on the global
batch (see :mod:`ds_conformance.zero_smoke` for the model and the tolerance). The runs share
the 2-rank group of the collective tests. Skipped where the backend has fewer than 2 devices
(one accelerator cannot host two ranks of most collective libraries); on ``cpu`` ranks are
processes.
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_conformance.marks import hooks, tier
from ds_conformance.ranks import RankGroups
from ds_conformance.zero_smoke import STAGES, WORLD, key

pytestmark = tier("multi-rank")


@hooks("ds_comm_all_reduce", "ds_comm_reduce_scatter", "ds_comm_all_gather", "ds_comm_broadcast")
@pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])
def test_training_matches_single_process_torch(
    acc: Any, rank_groups: RankGroups, stage: int
) -> None:
    rank_groups.result(acc, WORLD, key(stage))
